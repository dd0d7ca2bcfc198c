"""What `swiftkv serve` runs: its settings merged once, flags over SWIFTKV_* variables over the YAML config (or the
embedded default), and the platform config that comes of them, validated by the config model."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

ENGINES = ("ray", "inprocess")


class SettingsError(ValueError):
    """A setting `swiftkv serve` cannot run with; the message is the one line the command prints."""


class ServeSettings(BaseSettings):
    """Environment (SWIFTKV_*) defaults for `swiftkv serve`; command-line flags override them."""

    # An empty variable (SWIFTKV_WORKERS= in a pod spec) means unset, like an empty flag
    model_config = SettingsConfigDict(env_prefix="SWIFTKV_", env_ignore_empty=True)

    config: Optional[Path] = None
    engine: Literal["inprocess", "ray"] = "ray"
    host: Optional[str] = None
    port: Optional[int] = None
    api_keys_file: Optional[str] = None
    log_level: str = "info"
    log_format: str = "text"
    log_file: Optional[str] = None
    ray_metrics_port: int = 8080
    data_dir: Optional[str] = None
    database_url: Optional[str] = None
    redis_url: Optional[str] = None
    ray_address: Optional[str] = None
    workers: Optional[int] = None

    @classmethod
    def merged(cls, **flags) -> ServeSettings:
        """The settings of one start: each flag given over its SWIFTKV_* variable over the default. A flag left empty (None,
        "", and as before 0: `--port 0` does not override) means unset."""
        engine = flags.get("engine")
        if engine and engine not in ENGINES:
            raise SettingsError(f"--engine must be 'ray' or 'inprocess', not {engine!r}")
        try:
            return cls(**{name: value for name, value in flags.items() if value})
        except ValidationError as e:  # a bad variable (a flag is typed by its option)
            raise SettingsError("; ".join(f"SWIFTKV_{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}" for err in e.errors()))

    def log_options(self) -> tuple[str, str]:
        """(level, format), lower-cased and checked."""
        from services.logs import FORMATS, LEVELS

        level, fmt = self.log_level.lower(), self.log_format.lower()
        if level not in LEVELS:
            raise SettingsError(f"--log-level (SWIFTKV_LOG_LEVEL) must be one of {', '.join(LEVELS)}, not {self.log_level!r}")
        if fmt not in FORMATS:
            raise SettingsError(f"--log-format (SWIFTKV_LOG_FORMAT) must be one of {', '.join(FORMATS)}, not {self.log_format!r}")
        return level, fmt

    def config_overrides(self) -> dict:
        """The top-level config keys these settings override (None: the config's own value stands)."""
        return {"host": self.host, "port": self.port, "data_dir": self.data_dir, "database_url": self.database_url,
                "redis_url": self.redis_url, "ray_address": self.ray_address, "workers": self.workers}

    def platform_config(self):
        """The config file (or the embedded default) with these settings applied, validated; SettingsError says what is wrong."""
        from services.config import load_config

        if self.config is not None and not Path(self.config).exists():
            raise SettingsError(f"config file {self.config} does not exist")
        try:
            return load_config(self.config, self.config_overrides())
        except ValidationError as e:  # not str(e): it repeats the input, store URLs and their passwords included
            raise SettingsError(f"invalid config {self.config or '(default)'}: "
                                + "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors()))
        except ValueError as e:
            raise SettingsError(f"invalid config {self.config or '(default)'}: {e}")

    def keys_file(self, cfg) -> str | None:
        """The API keys file: --api-keys-file, else SWIFTKV_API_KEYS_FILE, else the config's api_keys_file."""
        return self.api_keys_file or cfg.api_keys_file


def printable_config(cfg, source: Path | None) -> str:
    """The effective platform config as YAML that `swiftkv serve --config` reads back, every setting spelled out;
    passwords in store URLs and remote pools' keys shown as ***."""
    import yaml

    data = cfg.model_dump(mode="json")
    for field in ("database_url", "redis_url"):
        if data.get(field):
            data[field] = hide_password(data[field])
    for pool in data["pools"].values():
        if pool.get("api_key"):
            pool["api_key"] = "***"
    header = (f"# The platform config `swiftkv serve` runs: {source or 'the embedded default'} with flags and SWIFTKV_* "
              "variables applied.\n# Passwords and keys are shown as ***.\n")
    return header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def hide_password(url: str) -> str:
    """`url` with its password (user:PASSWORD@, ?password=) replaced by ***, for messages and logs; works on
    URLs that SQLAlchemy or Redis would refuse to parse."""
    parts = urlsplit(url)
    userinfo, _, hostport = parts.netloc.rpartition("@")
    netloc = f"{userinfo.split(':', 1)[0]}:***@{hostport}" if ":" in userinfo else parts.netloc
    return urlunsplit(parts._replace(netloc=netloc, query=re.sub(r"(?i)\bpassword=[^&]*", "password=***", parts.query)))
