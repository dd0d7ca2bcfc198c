"""API keys: who a request's bearer key names, and that key's settings (its limits, priority floor and prefix-cache
sharing). The gateway, the Batch API and the trainer share one set of keys, so a key sees the same objects
everywhere. Only SHA-256 digests of the keys are kept.

The keys file is YAML (JSON is YAML too) with a top-level `keys:` list, each entry validated by `KeyEntry`:

    keys:
      - key: sk-team-a                      # or sha256: <64 hex digits>, the key's digest
        name: team-a                        # for operators and logs; never sent to a client
        limits: {requests_per_minute: 60, prompt_tokens_per_minute: 200000, output_tokens_per_minute: 20000}
        min_priority: -10                   # the most urgent priority this key may ask for (default 0)
        share_prefix_cache: false           # default: routing.share_prefix_cache

The line format of earlier releases (`key opt=value ...`, `sha256:<hex>`) is still read, with a deprecation warning,
for one release: `python -m services.common.keys convert OLD > keys.yaml` writes it in this format.

The running `KeyStore` re-reads its file when it changes (polled every `SWIFTKV_API_KEYS_RELOAD_SECONDS`, 2 s: its
mtime, inode and size, which also sees a Kubernetes Secret volume's symlink swap) and on SIGHUP, in each process that
serves keys (every gateway worker, the trainer); the new table replaces the old at once, so a revoked key's next
request is a 401, an added key works, and a changed limit or setting applies to the key's next request. A file that
does not validate is not loaded: the process keeps its keys, logs why and counts the failure."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Mapping

import yaml
from prometheus_client import Counter, Gauge
from pydantic import Field, ValidationError, field_validator, model_validator

from services.config import StrictModel

from .errors import APIError
from .waiting import wait_event

log = logging.getLogger("swiftkv.keys")

LIMIT_FIELDS = ("requests_per_minute", "prompt_tokens_per_minute", "output_tokens_per_minute")
# The most urgent engine priority a key's requests may ask for (lower runs first; live traffic's default is 0):
# 0 unless an operator trusts the key with less, so no tenant jumps the others' queue.
MIN_PRIORITY = "min_priority"
INT32_MIN = -(2**31)
RELOAD_SECONDS = 2.0  # how often a running KeyStore looks at its file (SWIFTKV_API_KEYS_RELOAD_SECONDS; 0: on SIGHUP only)

reloads = Counter("swiftkv_api_key_reloads", "Reloads of the API keys file by this process, by result: ok (the new keys "
                  "serve from the next request) or failed (the file did not read or validate: the previous keys stay, the "
                  "log says why)", ("result",))
loaded_keys = Gauge("swiftkv_api_keys", "API keys this process accepts (the keys file's and SWIFTKV_API_KEYS')")
for _result in ("ok", "failed"):  # both series exist from the start, so an alert on increase(...{result="failed"}) has one
    reloads.labels(_result)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# ---- one key's settings -------------------------------------------------------------------------------------------

class KeyLimits(StrictModel):
    """A key's own rate limits (token buckets per minute); a limit left out is the config's `limits.*` for every key."""

    requests_per_minute: int | None = Field(None, ge=1, description="requests this key may send per minute; past it a 429 "
                                            "with Retry-After. Default: limits.requests_per_minute")
    prompt_tokens_per_minute: int | None = Field(None, ge=1, description="prompt tokens this key may send per minute. "
                                                 "Default: limits.prompt_tokens_per_minute")
    output_tokens_per_minute: int | None = Field(None, ge=1, description="output tokens generated for this key per minute. "
                                                 "Default: limits.output_tokens_per_minute")


class KeySettings(StrictModel):
    """What a running process keeps of a key, under its digest: everything but the key."""

    name: str | None = Field(None, min_length=1, max_length=200, description="who the key belongs to (a team, a service): "
                             "named in the logs of a reload and in errors about this entry; never shown to a client")
    limits: KeyLimits = Field(default_factory=KeyLimits, description="this key's own per-minute limits")
    min_priority: int = Field(0, ge=INT32_MIN, le=0, description="the lowest (most urgent) `priority` this key's requests "
                              "may ask for, from -2147483648 to 0: below 0 a trusted key may run ahead of live traffic. "
                              "Default 0: no key jumps the others' queue")
    share_prefix_cache: bool | None = Field(None, description="true: this key's prompts share the engines' prefix cache with "
                                            "every other sharing key (trusted keys only: a shared cache's timing tells one "
                                            "what another sent); false: its cache is its own. Default: "
                                            "routing.share_prefix_cache (off)")
    max_concurrent_requests: int | None = Field(None, ge=1, description="generation, /tokenize and /detokenize requests "
                                                "this key may hold at once in one gateway process, from arrival (reading the "
                                                "body included) to the last byte; more are a 429. Default: "
                                                "limits.max_concurrent_requests_per_key")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> "KeySettings":
        """The settings of the former flat form: {limit name: value, "min_priority": value}."""
        options = dict(options)
        limits = {k: options.pop(k) for k in LIMIT_FIELDS if k in options}
        return cls.model_validate({**options, "limits": limits})

    def limit_values(self) -> dict[str, int]:
        """The limits this key sets itself, by field name."""
        limits = self.limits
        return {k: v for k in LIMIT_FIELDS if (v := getattr(limits, k)) is not None}


class KeyEntry(KeySettings):
    """One entry of the keys file: the key (or its digest) and its settings."""

    key: str | None = Field(None, min_length=1, max_length=4096, description="the bearer key itself "
                            "(no whitespace); only its SHA-256 digest is kept in memory. Give `key` or `sha256`, not both")
    sha256: str | None = Field(None, pattern=r"^(sha256:)?[0-9a-fA-F]{64}$", description="the key's SHA-256 digest in hex "
                               "(`printf %s KEY | sha256sum`), so the file need not hold the key")

    @field_validator("key")
    @classmethod
    def _no_whitespace(cls, v: str | None) -> str | None:
        if v is not None and any(c.isspace() for c in v):
            raise ValueError("a key has no whitespace (a bearer token is one word)")
        return v

    @field_validator("sha256")
    @classmethod
    def _lower(cls, v: str | None) -> str | None:
        return None if v is None else v.removeprefix("sha256:").lower()

    @model_validator(mode="after")
    def _one_key(self) -> "KeyEntry":
        if (self.key is None) == (self.sha256 is None):
            raise ValueError("give the key (`key:`) or its digest (`sha256:`), exactly one of them")
        return self

    @property
    def digest(self) -> str:
        return self.sha256 or digest(self.key or "")

    def settings(self) -> KeySettings:
        return KeySettings.model_validate(self.model_dump(exclude={"key", "sha256"}))


class KeysFile(StrictModel):
    """The keys file: `keys:`, a list of entries (empty: no key is accepted)."""

    keys: list[KeyEntry] = Field(description="the API keys and their settings")

    @field_validator("keys", mode="before")
    @classmethod
    def _a_list(cls, v):
        if not isinstance(v, list):
            raise ValueError("`keys:` must be a list of entries (`- key: ...`); `keys: []` accepts no key")
        return v


# ---- reading a keys file ------------------------------------------------------------------------------------------

def _where(loc: tuple, data: Any) -> str:
    """`keys[3] (alice).limits.requests_per_minute` for an error's location: the entry by index and name, never its key."""
    out = []
    for i, part in enumerate(loc):
        if isinstance(part, int) and i == 1 and loc[0] == "keys":
            name = None
            try:
                name = data["keys"][part].get("name")
            except (AttributeError, KeyError, IndexError, TypeError):
                pass
            out.append(f"[{part}]" + (f" ({name})" if isinstance(name, str) else ""))
        else:
            out.append(("." if out else "") + str(part))
    return "".join(out) or "file"


def _message(err: dict) -> str:
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        allowed = list(KeysFile.model_fields) if len(err["loc"]) == 1 else \
            list(KeyEntry.model_fields) if len(err["loc"]) == 3 else list(KeyLimits.model_fields)
        msg = f"unknown field (known: {', '.join(allowed)})"
    return msg


def parse_keys_file(text: str, source: str = "keys file") -> list[KeyEntry]:
    """The entries of a keys file in the YAML format; ValueError naming the entry and field of what is wrong (never the
    key itself: errors go to logs)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', None) or type(e).__name__}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with a `keys:` list, got {type(data).__name__}")
    try:
        entries = KeysFile.model_validate(data).keys
    except ValidationError as e:  # not str(e): it repeats the input, keys included
        raise ValueError(f"{source}: " + "; ".join(f"{_where(err['loc'], data)}: {_message(err)}" for err in e.errors())) from None
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        if entry.digest in seen:
            raise ValueError(f"{source}: {_where(('keys', i), data)}: the same key as keys[{seen[entry.digest]}]")
        seen[entry.digest] = i
    return entries


def is_line_format(text: str) -> bool:
    """Whether a keys file is in the former line format: its first line that is not blank or a comment is neither
    `keys:` nor JSON (a line-format file starts with a key, whose line never holds `: `)."""
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip() if not line.lstrip().startswith(("{", "[")) else line.strip()
        if not line or line == "---":
            continue
        return not (line.startswith(("{", "[", "keys:", "keys :")) or ": " in line or line.endswith(":"))
    return False  # blank: no entries in either format


def _option(option: str) -> tuple[str, int]:
    """`name=value` of a key's line -> (name, value): a limit is a positive integer, min_priority one in [-2**31, 0]."""
    name, _, value = option.partition("=")
    digits = value.removeprefix("-") if name == MIN_PRIORITY else value
    if digits.isascii() and digits.isdigit():  # '²' is a digit int() refuses
        number = int(value)
        if (name in LIMIT_FIELDS and number >= 1) or (name == MIN_PRIORITY and INT32_MIN <= number <= 0):
            return name, number
    raise ValueError(f"bad key option {option!r}: expected one of {', '.join(LIMIT_FIELDS)} = a positive integer, "
                     f"or {MIN_PRIORITY} = an integer from {INT32_MIN} to 0")


def parse_lines(lines: list[str]) -> list[KeyEntry]:
    """Entries of the line format (SWIFTKV_API_KEYS' values, and the former keys file): the key itself or `sha256:<hex>`,
    then optionally `requests_per_minute=60 ... min_priority=-10`; `#` starts a comment."""
    entries = []
    for n, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, *options = line.split()
        try:
            settings = KeySettings.from_options(dict(_option(o) for o in options)).model_dump()
        except ValueError as e:
            raise ValueError(f"line {n}: {e}") from None
        if key.startswith("sha256:"):
            hexd = key[len("sha256:"):]
            if len(hexd) != 64 or any(c not in "0123456789abcdefABCDEF" for c in hexd):
                raise ValueError(f"line {n}: a sha256: key entry needs 64 hex digits")
            entries.append(KeyEntry(sha256=hexd, **settings))
        else:
            entries.append(KeyEntry(key=key, **settings))
    return entries


def read_keys_file(path: str | Path) -> list[KeyEntry]:
    """The entries of a keys file, either format (the line format with a deprecation warning in the log)."""
    text = Path(path).read_text()
    if is_line_format(text):
        log.warning("API keys file %s: the line format (`key opt=value ...`) is deprecated and will not be read after the "
                    "next release; write it as YAML with `python -m services.common.keys convert %s > keys.yaml` "
                    "(docs/serving/index.md, \"Keys and limits\")", path, path)
        try:
            return parse_lines(text.splitlines())
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return parse_keys_file(text, str(path))


def load_table(env_value: str | None, file: str | Path | None) -> dict[str, KeySettings]:
    """digest -> settings of the keys of a comma-separated env value (`key` or `key opt=value ...`) and of a keys file;
    a key in both takes the file's settings."""
    entries = parse_lines([k.strip() for k in env_value.split(",")]) if env_value else []
    if file:
        entries += read_keys_file(file)
    return {e.digest: e.settings() for e in entries}


def load_keys(env_value: str | None, file: str | Path | None) -> dict[str, dict[str, int]]:
    """The former flat view of `load_table`: digest -> {limit name: value, "min_priority": value} of what the key sets."""
    return {d: s.limit_values() | ({MIN_PRIORITY: s.min_priority} if s.min_priority else {})
            for d, s in load_table(env_value, file).items()}


def convert_lines(text: str) -> str:
    """A line-format keys file in the YAML format (keys stay keys, digests digests; comments are dropped)."""
    out = []
    for entry in parse_lines(text.splitlines()):
        fields = entry.model_dump(exclude_defaults=True)
        out.append({k: fields.pop(k) for k in ("key", "sha256") if k in fields} | fields)
    return yaml.safe_dump({"keys": out}, sort_keys=False)


# ---- the running store --------------------------------------------------------------------------------------------

def reload_period() -> float:
    """SWIFTKV_API_KEYS_RELOAD_SECONDS: how often a running process looks at its keys file (0: on SIGHUP only)."""
    value = os.environ.get("SWIFTKV_API_KEYS_RELOAD_SECONDS") or ""
    if not value.strip():
        return RELOAD_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(f"SWIFTKV_API_KEYS_RELOAD_SECONDS={value!r}: expected seconds >= 0 (0: reload on SIGHUP only)")
    return seconds


def _signature(path: str) -> tuple | None:
    """What changes when the file does (stat follows symlinks: a Secret volume's `..data` swap changes the inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class KeyStore:
    """The accepted keys (digest -> settings). `reload()` re-reads the file and swaps the table in one assignment, so a
    request sees either the old keys or the new ones; `start_watching()` reloads on change and on SIGHUP."""

    def __init__(self, digests: Mapping[str, KeySettings | Mapping[str, Any]] | None = None, *, env_value: str | None = None,
                 file: str | Path | None = None, reload_seconds: float | None = None):
        self.table: dict[str, KeySettings] = {d: s if isinstance(s, KeySettings) else KeySettings.from_options(s)
                                              for d, s in (digests or {}).items()}
        self.env_value = env_value
        self.file = str(file) if file else None
        self.reload_seconds = reload_period() if reload_seconds is None else reload_seconds
        self._seen = _signature(self.file) if self.file else None
        self._task: asyncio.Task | None = None
        self._hup: tuple | None = None  # (loop, the SIGHUP handler before ours) while watching in a main thread
        self._lock = threading.Lock()  # one reload at a time (the watcher's and a direct call's)
        self.generation = 0  # counts the tables loaded: a user of the settings (the rate limiter) sees a reload by it

    @classmethod
    def from_env(cls, file: str | None) -> "KeyStore":
        """Keys from SWIFTKV_API_KEYS plus `file`, which the caller resolved (flag, then environment, then config)."""
        env_value = os.environ.get("SWIFTKV_API_KEYS")
        signature = _signature(file) if file else None
        store = cls(load_table(env_value, file), env_value=env_value, file=file)
        store._seen = signature  # taken before the read: a write during it is seen by the next look
        loaded_keys.set(len(store.table))
        return store

    @property
    def digests(self) -> dict[str, KeySettings]:
        return self.table

    @property
    def enabled(self) -> bool:
        """Whether requests need a key: with a keys file, always (a file that lists none accepts none; revoking the
        last key never opens the API)."""
        return bool(self.table) or self.file is not None

    # ---- a key's settings (the current table's, read per request) ----
    def settings(self, identity: str) -> KeySettings | None:
        return self.table.get(identity)

    def min_priority(self, identity: str) -> int:
        """The lowest priority value (the most urgent) this key's requests may ask for."""
        s = self.table.get(identity)
        return 0 if s is None else s.min_priority

    def limits(self, identity: str) -> dict[str, int]:
        """The per-minute limits this key sets itself, by field name (the rest are the config's)."""
        s = self.table.get(identity)
        return {} if s is None else s.limit_values()

    def own_cache(self, identity: str, shared_by_default: bool = False) -> bool:
        """Whether this key's prefix cache is kept apart from other keys' (its `share_prefix_cache`, else the default)."""
        if not self.enabled or identity == "anonymous":
            return False
        s = self.table.get(identity)
        shared = shared_by_default if s is None or s.share_prefix_cache is None else s.share_prefix_cache
        return not shared

    def identify(self, authorization: str | None) -> str:
        """The caller's identity (key digest); raises 401 when keys are configured and this one is not valid."""
        if not self.enabled:
            return "anonymous"
        if not authorization or not authorization.lower().startswith("bearer "):
            raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'", "invalid_request_error", code="invalid_api_key")
        d = digest(authorization[7:].strip())
        # a dict lookup on the digest: its timing tells nothing usable about a key (the digest of a guess is not the key)
        if d in self.table:
            return d
        raise APIError(401, "invalid API key", "invalid_request_error", code="invalid_api_key")

    # ---- reloading ----
    def reload(self, why: str = "requested") -> bool:
        """Re-read the keys file (and keep the environment's keys): -> True and the new table in use, or False with the
        old one kept, the error logged and counted."""
        if self.file is None:
            return True
        with self._lock:
            self._seen = _signature(self.file)
            try:
                table = load_table(self.env_value, self.file)
            except (OSError, ValueError) as e:
                reloads.labels("failed").inc()
                log.error("API keys file %s (%s): not reloaded, the %d keys loaded before stay in use: %s", self.file, why,
                          len(self.table), e)
                return False
            old, self.table = self.table, table  # one assignment: a request reads the old table or the new one
            self.generation += 1
            reloads.labels("ok").inc()
            loaded_keys.set(len(table))
            added = [d for d in table if d not in old]
            revoked = [d for d in old if d not in table]
            changed = [d for d in table if d in old and table[d] != old[d]]

            def names(ds: list[str], t: dict[str, KeySettings]) -> str:
                return ", ".join(t[d].name or f"sha256:{d[:12]}" for d in ds[:20]) + (" ..." if len(ds) > 20 else "")

            log.info("API keys reloaded from %s (%s): %d keys; added %d%s, revoked %d%s, changed %d%s", self.file, why, len(table),
                     len(added), f" ({names(added, table)})" if added else "", len(revoked),
                     f" ({names(revoked, old)})" if revoked else "", len(changed), f" ({names(changed, table)})" if changed else "")
            return True

    def check(self) -> bool | None:
        """Reload if the file changed since it was last read: -> reload()'s answer, or None when unchanged."""
        if self.file is None or _signature(self.file) == self._seen:
            return None
        return self.reload("the file changed")

    def start_watching(self) -> None:
        """In a running event loop: reload when the file changes (polled every reload_seconds) and on SIGHUP (where
        this thread takes signals: the main thread of a server process)."""
        if self.file is None or self._task is not None:
            return
        hup = asyncio.Event()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
            loop = asyncio.get_running_loop()
            before = signal.getsignal(signal.SIGHUP)
            try:
                loop.add_signal_handler(signal.SIGHUP, hup.set)
                self._hup = (loop, before)
            except (ValueError, RuntimeError, NotImplementedError):  # not the loop's thread, or no signals here
                pass
        self._task = asyncio.create_task(self._watch(hup), name="swiftkv-keys-watch")

    async def _watch(self, hup: asyncio.Event) -> None:
        # A change made while this process started (a SIGHUP then was ignored: no handler yet) is taken now.
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.check)
        while True:
            if self.reload_seconds > 0:
                await wait_event(hup, self.reload_seconds)
            else:
                await hup.wait()
            try:
                if hup.is_set():
                    hup.clear()
                    await asyncio.to_thread(self.reload, "SIGHUP")
                else:
                    await asyncio.to_thread(self.check)
            except Exception:  # never let the watcher die: the next change is tried again
                log.exception("API keys: reload failed")

    async def stop_watching(self) -> None:
        if self._task is None:
            return
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        if self._hup is not None:
            loop, before = self._hup
            loop.remove_signal_handler(signal.SIGHUP)  # which puts back SIG_DFL: a late SIGHUP would end the process
            signal.signal(signal.SIGHUP, before if before is not None else signal.SIG_DFL)
            self._hup = None


def _main(argv: list[str]) -> int:
    """`python -m services.common.keys convert OLD`: a line-format keys file in the YAML format, on stdout;
    `python -m services.common.keys check FILE`: validate a keys file (either format) without serving it."""
    if len(argv) != 2 or argv[0] not in ("convert", "check"):
        print("usage: python -m services.common.keys convert OLD_KEYS_FILE > keys.yaml\n"
              "       python -m services.common.keys check KEYS_FILE", file=sys.stderr)
        return 2
    try:
        if argv[0] == "convert":
            sys.stdout.write(convert_lines(Path(argv[1]).read_text()))
        else:
            print(f"{argv[1]}: {len(read_keys_file(argv[1]))} keys")
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
