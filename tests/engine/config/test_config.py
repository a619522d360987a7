"""`EngineConfig` is the only configuration: every setting, nested sections included, is a trainer flag
`rollout_<flag>` and is read by exactly the modules its help names (`setting(..., readers)`, the trainer flag's
"Read in ..."); the option classes it replaced are gone.

The readers are found in the source (every module under `trl_infinite/`, CUDA-only paths included): an attribute
read `x.<name>` where `x` is known to be the setting's section, from an annotation (`config: SchedulingConfig`), an
assignment from something known (`decode = self.config.decode`, `self.config = config`) or a class field
(`engine: EngineConfig`). A section's properties (`SchedulingConfig.max_batch`) count as reads of what they read.
`engine/config/engine_config.py`, `engine/config/scheduling.py` and `engine/config/sections.py` declare and validate the
settings and are not readers.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

import trl_infinite
from trl_infinite.engine import EngineConfig
from trl_infinite.engine.config.sections import Section, flags

PKG = Path(trl_infinite.__file__).parent
DECLARING = {"engine/config/engine_config.py", "engine/config/scheduling.py", "engine/config/sections.py"}


def _sections(cls: type) -> dict[str, type]:
    out = {cls.__name__: cls}
    for f in dataclasses.fields(cls):
        if "section" in f.metadata:
            out.update(_sections(f.metadata["section"]))
    return out


SECTIONS = _sections(EngineConfig)  # class name -> section class


def _section_type(annotation: ast.expr | None) -> type | None:
    """The section class an annotation names (`SchedulingConfig`, `EngineConfig | None`, a string of them)."""
    if annotation is None:
        return None
    text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
    named = [cls for name, cls in SECTIONS.items() if name in str(text).replace("|", " ").split()]
    return named[0] if len(named) == 1 else None


def _property_reads() -> dict[tuple[type, str], set[str]]:
    """(section, property) -> the settings the property reads through `self`."""
    out: dict[tuple[type, str], set[str]] = {}
    for cls in SECTIONS.values():
        for name, value in vars(cls).items():
            if isinstance(value, property):
                tree = ast.parse(ast.get_source_segment(_CONFIG_SOURCE, _function_node(cls, name)))
                out[cls, name] = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                                  and isinstance(n.value, ast.Name) and n.value.id == "self"}
    return out


_CONFIG_SOURCE = "\n".join(p.read_text() for p in sorted((PKG / "engine" / "config").glob("*.py")))


def _function_node(cls: type, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(_CONFIG_SOURCE)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == name)
    raise LookupError(name)


def _class_fields(trees: dict[str, ast.Module]) -> dict[str, type]:
    """Attribute names that hold a section wherever they are declared or assigned (`engine: EngineConfig`,
    `self.engine_config = config` with `config: EngineConfig`), when every such place agrees."""
    seen: dict[str, set[type]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                cls = _section_type(node.annotation)
                if cls is not None:
                    seen.setdefault(node.target.id, set()).add(cls)
    return {name: next(iter(types)) for name, types in seen.items() if len(types) == 1}


class _Reads(ast.NodeVisitor):
    """The settings one module reads: (section class, setting name) pairs."""

    def __init__(self, fields_by_name: dict[str, type], properties: dict[tuple[type, str], set[str]]):
        self.fields_by_name = fields_by_name
        self.properties = properties
        self.scopes: list[dict[str, type]] = [{}]
        self.self_attrs: list[dict[str, type]] = [{}]
        self.reads: set[tuple[type, str]] = set()

    def type_of(self, node: ast.expr) -> type | None:
        if isinstance(node, ast.BoolOp):  # `config or EngineConfig()`
            return next((t for t in map(self.type_of, node.values) if t is not None), None)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):  # `EngineConfig(...)`
            return SECTIONS.get(node.func.id)
        if isinstance(node, ast.Name):
            for scope in reversed(self.scopes):
                if node.id in scope:
                    return scope[node.id]
            return None
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.self_attrs[-1]:
                return self.self_attrs[-1][node.attr]
            owner = self.type_of(node.value)
            if owner is not None:
                f = {f.name: f for f in dataclasses.fields(owner)}.get(node.attr)
                return f.metadata.get("section") if f is not None else None
            return self.fields_by_name.get(node.attr)
        return None

    def _bind(self, target: ast.expr, value: ast.expr) -> None:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                self._bind(t, v)
            return
        cls = self.type_of(value)
        if isinstance(target, ast.Name):
            if cls is not None:
                self.scopes[-1][target.id] = cls
            else:
                self.scopes[-1].pop(target.id, None)
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            if cls is not None:
                self.self_attrs[-1][target.attr] = cls

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        attrs: dict[str, type] = {}
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                cls = _section_type(item.annotation)
                if cls is not None:
                    attrs[item.target.id] = cls
        self.self_attrs.append(attrs)
        # two passes: `self.x = ...` in any method is known in every method
        for _ in range(2):
            for item in node.body:
                self.visit(item)
        self.self_attrs.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        scope = {}
        args = node.args
        for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
            cls = _section_type(arg.annotation)
            if cls is not None:
                scope[arg.arg] = cls
        self.scopes.append(scope)
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        self.visit(node.value)
        for target in node.targets:
            self._bind(target, node.value)
            self.visit(target)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)
            self._bind(node.target, node.value)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        owner = self.type_of(node.value)
        if owner is not None:
            names = {f.name for f in dataclasses.fields(owner) if "section" not in f.metadata}
            if node.attr in names:
                self.reads.add((owner, node.attr))
            for name in self.properties.get((owner, node.attr), ()):
                self.reads.add((owner, name))
        self.generic_visit(node)


def _modules() -> dict[str, ast.Module]:
    return {path.relative_to(PKG).as_posix(): ast.parse(path.read_text()) for path in sorted(PKG.rglob("*.py"))}


def _readers() -> dict[tuple[type, str], set[str]]:
    trees = _modules()
    fields_by_name, properties = _class_fields(trees), _property_reads()
    out: dict[tuple[type, str], set[str]] = {}
    for module, tree in trees.items():
        if module in DECLARING:
            continue
        visitor = _Reads(fields_by_name, properties)
        visitor.visit(tree)
        for key in visitor.reads:
            out.setdefault(key, set()).add(module)
    return out


READERS = _readers()


@pytest.mark.parametrize("flag", flags(EngineConfig), ids=lambda f: f.name)
def test_every_setting_is_read_by_exactly_the_code_its_help_names(flag):
    from trl_infinite.trainer.config import flag_help

    found = READERS.get((flag.owner, flag.path[-1]), set())
    assert found == set(flag.readers), f"`{flag.name}` is read in {sorted(found)}, its help names {flag.readers}"
    assert all((PKG / m).is_file() for m in flag.readers)
    assert flag_help(flag).endswith("Read in " + ", ".join(f"`{m}`" for m in flag.readers) + ".")


@pytest.mark.parametrize("flag", [f for f in flags(EngineConfig) if f.field.type != "object"], ids=lambda f: f.name)
def test_every_setting_refuses_a_bad_value_naming_its_flag(flag):
    """Checked against its declaration (`Section.__post_init__`): the wrong type, below its minimum, outside its
    bounds, not one of its choices; the error names the flag, whichever way the config is built."""
    meta, kind = flag.field.metadata, flag.field.type
    bad = ["no-such"] if kind != "str" or meta["choices"] is not None else []
    if kind.startswith("int"):
        bad += [meta["minimum"] - 1, 2.5, True]
    if kind.startswith("float") and meta["bounds"] is not None:
        bad += [float(meta["bounds"][1:-1].split(",")[1]) + 1.0, float("nan")]
    if flag.name == "compile_backend":  # checked against Dynamo's backends when `compile` is on
        bad, extra = ["no-such"], {"compile": True}
    else:
        extra = {}
    for value in bad:
        with pytest.raises(ValueError, match=f"`{flag.name}`"):
            EngineConfig(**{flag.name: value}, **extra)


def test_sections_and_flags_build_the_same_config():
    """Flat flags, nested sections, or sections with flags on top: one config; a wrong name is a `TypeError` with the
    closest flag."""
    from trl_infinite.engine.config.engine_config import KVCacheConfig
    from trl_infinite.engine.config.scheduling import SchedulingConfig, SLAConfig

    flat = EngineConfig(kv_cache_tokens=512, batch_policy="sla", sla_decode_ms=5.0, sla_window=2, block_size=8)
    nested = EngineConfig(kv_cache=KVCacheConfig(tokens=512), block_size=8,
                          scheduling=SchedulingConfig(batch_policy="sla", sla=SLAConfig(decode_ms=5.0, window=2)))
    assert flat == nested
    mixed = EngineConfig(scheduling=SchedulingConfig(scheduler="sjf", sla=SLAConfig(alpha=3)), sla_window=7)
    assert (mixed.scheduling.scheduler, mixed.scheduling.sla.alpha, mixed.scheduling.sla.window) == ("sjf", 3, 7)
    with pytest.raises(ValueError, match="kv_cache_gb"):
        EngineConfig(kv_cache=KVCacheConfig(tokens=512), kv_cache_gb=1.0)
    with pytest.raises(TypeError, match="did you mean 'sla_window'"):
        EngineConfig(sla_windw=3)


def test_every_setting_is_a_trainer_flag_with_the_engines_default():
    """`rollout_<flag>` for each setting (nested ones included), set through the trainer config, reaches the
    setting's place in `EngineConfig`."""
    from trl_infinite.trainer import InfiniteGRPOConfig, engine_config_from_args
    from trl_infinite.trainer.config import TRAINER_ONLY

    twins = {f.name: f for f in dataclasses.fields(InfiniteGRPOConfig)}
    assert {n for n in twins if n.startswith("rollout_")} - set(TRAINER_ONLY) == {
        f"rollout_{f.name}" for f in flags(EngineConfig)}
    assert len({f.name for f in flags(EngineConfig)}) == len(flags(EngineConfig))  # one name per setting
    for flag in flags(EngineConfig):
        assert twins[f"rollout_{flag.name}"].default == flag.default, flag.name
    args = InfiniteGRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, rollout_sla_window=9,
                              rollout_speculative_suffix_min_match=3, rollout_kv_cache_tokens=4096,
                              rollout_history_fallback="prefix", rollout_block_size=8)
    cfg = engine_config_from_args(args)
    assert (cfg.scheduling.sla.window, cfg.speculative.suffix.min_match, cfg.kv_cache.tokens,
            cfg.scheduling.history_predictor.fallback, cfg.block_size) == (9, 3, 4096, "prefix", 8)


def test_the_finder_sees_reads_through_each_way_a_section_is_known():
    """The reader search itself: annotations, assignments, tuple assignments, `self` attributes, class fields and
    properties are all followed (so a reader it misses fails the test above rather than passing it)."""
    source = '''
class Holder:
    engine: EngineConfig

    def __init__(self, config: SchedulingConfig, whole: EngineConfig | None):
        whole = whole or EngineConfig()
        self.spec = whole.speculative
        decode, bs = whole.decode, whole.block_size
        decode.compile
        config.sla.window
        config.max_batch

    def later(self):
        self.spec.num_tokens
        self.engine.kv_cache.tokens
'''
    visitor = _Reads({}, _property_reads())
    visitor.visit(ast.parse(source))
    got = {(cls.__name__, name) for cls, name in visitor.reads}
    assert got == {("EngineConfig", "block_size"), ("DecodeConfig", "compile"), ("SLAConfig", "window"),
                   ("SchedulingConfig", "max_active_sequences"), ("SpeculativeConfig", "num_tokens"),
                   ("KVCacheConfig", "tokens")}


def test_the_option_classes_it_replaced_are_gone():
    source = "\n".join(path.read_text() for path in PKG.rglob("*.py"))
    for name in ("PolicyOptions", "PredictorOptions", "SchedulerCounters", "CallSummary", "EpochSummary",
                 "policies_from_config", "predictor_from_config"):
        assert name not in source, name
    # the simulator's config is the engine's plus trace options, not a copy of its fields
    from trl_infinite.sim import SimConfig

    sim_fields = {f.name for f in dataclasses.fields(SimConfig)}
    assert sim_fields == {"engine", "prompts_per_call", "max_new_tokens", "step_ms"}
    assert all(issubclass(cls, Section) for cls in SECTIONS.values())


@pytest.mark.parametrize("value", [123, 1.5, ["model"], {"path": "x"}, True])
def test_speculative_draft_model_must_be_a_module_or_a_path(value):
    """Regression: `speculative_draft_model=123` went to `from_pretrained` (the Hub)."""
    with pytest.raises(ValueError, match=r"`speculative_draft_model` must be a `torch.nn.Module`, a local path"):
        EngineConfig(speculative_method="draft_model", speculative_draft_model=value)
    EngineConfig(speculative_method="draft_model", speculative_draft_model="some/local-path")  # loaded by the engine


def test_compile_is_refused_on_a_torch_too_old_for_it(monkeypatch):
    import trl_infinite.engine.config.engine_config as ec

    assert ec.compile_supported("2.9.0") and ec.compile_supported("2.13.0+cpu") and not ec.compile_supported("2.8.1")
    monkeypatch.setattr(ec, "compile_supported", lambda: False)
    with pytest.raises(ValueError, match="needs torch >= 2.9"):
        EngineConfig(compile=True)
    EngineConfig(compile=False)  # the uncompiled step runs on every supported torch
