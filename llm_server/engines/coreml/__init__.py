"""The Core ML engine (macOS): stateful .mlpackage graphs from llm-convert --to coreml."""
