"""tripath: phase-routed attention for LLM serving (decode / extend / prefill), in Triton and PyTorch."""

__version__ = "0.1.0"
