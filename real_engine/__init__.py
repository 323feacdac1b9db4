"""latsim's real engine: a PyTorch Llama-style model served with continuous
batching over the simulator's own scheduling policies and a paged KV cache.

It (a) profiles step costs into a ``latsim-profile/1`` JSON the simulator's cost
model reads (``real_engine.profile``) and (b) serves traces in real time so the
simulator can be validated against it (``real_engine.runner``). Needs torch.

Entry points:
    build_model(name_or_path, device, dtype=None, seed=0) -> Transformer
    build_engine(model, device, policy="chunked", ...) -> EngineCore
    run_profile(model, device, out=None, quick=False, ...) -> dict
    run_trace(engine, arrivals_s, prompt_tokens, output_tokens, priority, realtime=True) -> dict
"""
from real_engine.engine import EngineCore, StepResult
from real_engine.model import PRESETS, ModelConfig, Transformer, build_model
from real_engine.profile import build_engine, run_profile, time_step_components
from real_engine.runner import run_trace


__all__ = ["EngineCore", "StepResult", "PRESETS", "ModelConfig", "Transformer", "build_model",
           "build_engine", "run_profile", "time_step_components", "run_trace"]
