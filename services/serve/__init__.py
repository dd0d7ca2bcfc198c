"""`swiftkv serve` and `swiftkv demo`, in four parts that depend one way (command -> runtime -> preflight, settings):

- settings: ServeSettings, the one merge of flags over SWIFTKV_* variables over the YAML config, and the platform config
  that comes of it;
- preflight: the rules that refuse or adjust a platform's pools before any engine starts;
- runtime: the process that runs the platform (one gateway, or several workers: workers), the Ray cluster and Ray
  Serve applications it starts, the engines' lifecycle;
- command: the Typer commands.
"""

from __future__ import annotations

from .command import demo_command, register_serving_commands, serve_command
from .preflight import (
    Refusal,
    check_engine_choice,
    check_machine,
    check_models,
    checkpoint_dual_mode_refusal,
    default_dual_mode,
    default_models,
    default_speculation,
    dual_mode_refusal,
    fit_the_default,
    local_hf_config,
    speculation_refusal,
)
from .runtime import run_platform
from .settings import ServeSettings, SettingsError, hide_password, printable_config

__all__ = [
    "Refusal", "ServeSettings", "SettingsError", "check_engine_choice", "check_machine", "check_models", "checkpoint_dual_mode_refusal",
    "default_dual_mode", "default_models", "default_speculation", "demo_command", "dual_mode_refusal", "fit_the_default",
    "hide_password", "local_hf_config", "printable_config", "register_serving_commands", "run_platform", "serve_command",
    "speculation_refusal",
]
