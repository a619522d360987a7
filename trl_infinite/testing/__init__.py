"""Developer tools (tests, benchmarks, the model matrix): tiny model configs, random-weight models, the offline
SmolLM2 weights and tokenizer, the shared data sets. Nothing in the engine, the trainer or the simulator imports this
package (`tests/test_architecture.py`)."""
