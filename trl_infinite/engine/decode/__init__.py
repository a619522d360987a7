"""The decode-step protocol (`step`: static, eager and speculative steps behind `launch(batch) -> complete`) and the
fast decode step: one token per running sample through fixed-shape device state (`static`, `rows`), its
CUDA graphs (`graphs`, `cuda_graphs`) and their CPU emulation (`cpu_graphs`), and the `torch.compile`d step
(`compiled`, `output_capture`)."""
