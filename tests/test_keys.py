"""API keys as tenants: the keys file's one format (YAML/JSON, each entry validated by services.common.keys.KeyEntry),
its errors naming the entry and field, the former line format still read, and the keys reloaded without a restart:
in the real gateway app served by uvicorn (a change of the file: keys added, limits and settings changed, keys
revoked with a 401 on their next request, a bad file keeping the old keys), in every worker of `swiftkv serve
--workers 2` on SIGHUP, in the trainer (`swiftkv trainer serve`), and in the chart's Secret (the Redis limiter: test_keys_redis.py)."""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from harness import FakeBackend, free_port, metric, scrape, swiftkv_serve, wait_until
from harness.deploy import CHART, find, render, run, tool
from harness.gateway import InProcessGateway, ThreadedServer, platform_config
from harness.training import Trainer

from services.common.keys import (
    KeyEntry,
    KeyStore,
    convert_lines,
    digest,
    is_line_format,
    load_keys,
    load_table,
    parse_keys_file,
    read_keys_file,
)

HI = [{"role": "user", "content": "hi"}]


def write(path: Path, entries: list[dict]) -> None:
    """The keys file, replaced as an editor or kubectl would (a new file renamed over the old: a new inode)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"keys": entries}, sort_keys=False))
    os.replace(tmp, path)


# ---- the format --------------------------------------------------------------------------------------------------

def test_a_keys_file_in_yaml_and_in_json_gives_each_key_its_settings(tmp_path):
    f = tmp_path / "keys.yaml"
    f.write_text(f"""\
# tenants of the platform
keys:
  - key: sk-team-a
    name: team-a
    limits: {{requests_per_minute: 60, output_tokens_per_minute: 20000}}
  - sha256: {digest("sk-batch").upper()}
    name: batch-scheduler
    min_priority: -10
    share_prefix_cache: true
  - key: sk-plain
""")
    table = load_table("sk-env", f)
    assert set(table) == {digest("sk-team-a"), digest("sk-batch"), digest("sk-plain"), digest("sk-env")}
    assert "sk-team-a" not in repr(table)  # only digests are kept
    a = table[digest("sk-team-a")]
    assert a.name == "team-a" and a.limit_values() == {"requests_per_minute": 60, "output_tokens_per_minute": 20000}
    store = KeyStore(table)
    assert store.min_priority(digest("sk-batch")) == -10 and store.min_priority(digest("sk-plain")) == 0
    assert store.own_cache(digest("sk-plain")) and not store.own_cache(digest("sk-batch"))
    assert not store.own_cache(digest("sk-plain"), shared_by_default=True)  # routing.share_prefix_cache is the default
    assert store.limits(digest("sk-plain")) == {}

    j = tmp_path / "keys.json"  # JSON is YAML
    j.write_text(json.dumps({"keys": [{"key": "sk-j", "limits": {"prompt_tokens_per_minute": 5}}]}))
    assert load_table(None, j)[digest("sk-j")].limit_values() == {"prompt_tokens_per_minute": 5}
    assert load_table(None, _file(tmp_path, "keys: []\n")) == {}


def _file(tmp_path: Path, text: str) -> Path:
    f = tmp_path / f"keys-{secrets.token_hex(3)}.yaml"
    f.write_text(text)
    return f


@pytest.mark.parametrize("text,message", [
    ("keys:\n  - key: sk-secret-1\n    name: alice\n    limits: {requests_per_minute: 0}\n",
     "keys[0] (alice).limits.requests_per_minute: Input should be greater than or equal to 1"),
    ("keys:\n  - key: sk-secret-1\n  - key: sk-secret-2\n    limits: {rpm: 5}\n",
     "keys[1].limits.rpm: unknown field (known: requests_per_minute, prompt_tokens_per_minute, output_tokens_per_minute)"),
    ("keys:\n  - key: sk-secret-1\n    min_priority: 3\n", "keys[0].min_priority: Input should be less than or equal to 0"),
    (f"keys:\n  - key: sk-secret-1\n    min_priority: {-(2**31) - 1}\n", "keys[0].min_priority: Input should be greater than or equal to -2147483648"),
    ("keys:\n  - key: sk-secret-1\n    share_prefix_cache: maybe\n", "keys[0].share_prefix_cache: Input should be a valid boolean"),
    ("keys:\n  - name: bob\n", "keys[0] (bob): give the key (`key:`) or its digest (`sha256:`), exactly one of them"),
    (f"keys:\n  - key: sk-secret-1\n    sha256: {'a' * 64}\n", "keys[0]: give the key (`key:`) or its digest"),
    ("keys:\n  - sha256: abc\n", "keys[0].sha256: String should match pattern"),
    ("keys:\n  - key: sk secret\n", "keys[0].key: a key has no whitespace"),
    ("keys:\n  - key: sk-secret-1\n    priority_floor: -1\n", "keys[0].priority_floor: unknown field (known: name, limits, min_priority"),
    ("keys:\n  - key: sk-secret-1\n  - key: sk-secret-1\n    name: again\n", "keys[1] (again): the same key as keys[0]"),
    ("keys: sk-secret-1\n", "keys: `keys:` must be a list of entries"),
    ("tenants:\n  - key: sk-secret-1\n", "tenants: unknown field (known: keys)"),
    ("keys:\n  - key: [sk-secret-1\n", "not valid YAML at line 3"),
])
def test_a_bad_keys_file_is_refused_naming_the_entry_and_field_never_the_key(tmp_path, text, message):
    f = _file(tmp_path, text)
    with pytest.raises(ValueError) as e:
        load_table(None, f)
    assert message in str(e.value) and str(f) in str(e.value)
    assert "sk-secret" not in str(e.value)  # errors go to logs: they never repeat a key


def test_the_line_format_is_still_read_with_a_deprecation_warning_and_converts(tmp_path, caplog):
    old = _file(tmp_path, f"# tenants\nsk-a requests_per_minute=60 min_priority=-3\nsha256:{digest('sk-b')}\n\nsk-c  # plain\n")
    assert is_line_format(old.read_text()) and not is_line_format("keys: []") and not is_line_format('{"keys": []}')
    with caplog.at_level(logging.WARNING, "swiftkv.keys"):
        table = load_table(None, old)
    assert "line format" in caplog.text and "deprecated" in caplog.text and "convert" in caplog.text
    assert load_keys(None, old)[digest("sk-a")] == {"requests_per_minute": 60, "min_priority": -3}
    converted = convert_lines(old.read_text())
    assert converted.startswith("keys:\n- key: sk-a\n")
    assert {e.digest: e.settings() for e in parse_keys_file(converted)} == table
    with pytest.raises(ValueError, match="line 2: bad key option 'rpm=1'"):
        read_keys_file(_file(tmp_path, "sk-a\nsk-b rpm=1\n"))
    # the command an operator runs
    out = subprocess.run([sys.executable, "-m", "services.common.keys", "convert", str(old)], capture_output=True, text=True, check=True)
    assert out.stdout == converted
    bad = subprocess.run([sys.executable, "-m", "services.common.keys", "check", str(_file(tmp_path, "keys:\n  - {key: k, min_priority: 1}\n"))],
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "keys[0].min_priority" in bad.stderr


def test_swiftkv_serve_refuses_to_start_on_a_bad_keys_file(tmp_path, tiny_base):
    keys = _file(tmp_path, "keys:\n  - key: sk-secret-1\n    limits: {requests_per_minute: -5}\n")
    config = {"model": "m", "data_dir": str(tmp_path / "data"),
              "pools": {"base": {"backend": "remote", "url": "http://127.0.0.1:9/v1", "model": str(tiny_base)}}}
    server = swiftkv_serve(tmp_path, config, "--engine", "inprocess", "--api-keys-file", str(keys))
    server.start()
    assert server.proc.wait(120) == 2
    out = server.log_path.read_text()
    assert "keys[0].limits.requests_per_minute: Input should be greater than or equal to 1" in out and "sk-secret" not in out


def test_a_bad_reload_period_is_refused_naming_the_variable(monkeypatch, tmp_path):
    f = _file(tmp_path, "keys: []\n")
    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("SWIFTKV_API_KEYS_RELOAD_SECONDS", bad)
        with pytest.raises(ValueError, match="SWIFTKV_API_KEYS_RELOAD_SECONDS"):
            KeyStore.from_env(str(f))
    monkeypatch.setenv("SWIFTKV_API_KEYS_RELOAD_SECONDS", "0")
    assert KeyStore.from_env(str(f)).reload_seconds == 0


def test_a_keys_file_with_no_keys_accepts_none():
    """A keys file, even one that lists no key, means every request needs one: revoking the last key never opens the API."""
    store = KeyStore({}, file="/nonexistent/keys.yaml")
    assert store.enabled
    with pytest.raises(Exception) as e:
        store.identify("Bearer anything")
    assert e.value.status == 401
    assert KeyStore({}).identify(None) == "anonymous"  # no keys at all: open, as before


def test_a_kubernetes_secret_volume_update_is_seen(tmp_path):
    """The kubelet updates a Secret volume by writing a new timestamped folder and swapping the `..data` symlink that
    `keys.txt -> ..data/keys.txt` goes through: the file's own path never changes, its inode does."""
    volume = tmp_path / "keys"
    volume.mkdir()

    def publish(stamp: str, entries: list[dict]) -> None:
        folder = volume / f"..{stamp}"
        folder.mkdir()
        (folder / "keys.txt").write_text(yaml.safe_dump({"keys": entries}))
        (volume / "..data_tmp").symlink_to(folder.name)
        os.replace(volume / "..data_tmp", volume / "..data")

    publish("2026_01_01_00_00_00.1", [{"key": "sk-one"}])
    (volume / "keys.txt").symlink_to("..data/keys.txt")
    store = KeyStore.from_env(str(volume / "keys.txt"))
    assert store.check() is None  # unchanged
    assert store.identify("Bearer sk-one") == digest("sk-one")
    publish("2026_01_01_00_01_00.2", [{"key": "sk-two"}])
    assert store.check() is True
    assert store.identify("Bearer sk-two") == digest("sk-two")
    with pytest.raises(Exception) as e:
        store.identify("Bearer sk-one")
    assert e.value.status == 401


# ---- reloads in a running gateway --------------------------------------------------------------------------------

def ask(base: str, key: str, **fields) -> httpx.Response:
    body = {"model": "m", "messages": HI, "max_tokens": 2, **fields}
    return httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def reloads(base: str, key: str, result: str) -> float:
    return metric(scrape(base, key), "swiftkv_api_key_reloads_total", result=result)


@pytest.fixture
def watched(tiny_base, tmp_path):
    """(server, keys file, backend) of the real gateway app under uvicorn whose KeyStore reads a keys file and
    watches it every 0.1 s; alice may send 1 request a minute."""
    f = tmp_path / "keys.yaml"
    write(f, [{"key": "sk-alice", "name": "alice", "limits": {"requests_per_minute": 1}}, {"key": "sk-bob", "name": "bob"}])
    cfg = platform_config(tiny_base, ("base",), data_dir=str(tmp_path / "data"))
    backend = FakeBackend("base", tokens=1)
    store = KeyStore(load_table(None, f), file=f, reload_seconds=0.1)
    with ThreadedServer(InProcessGateway(cfg, {"base": backend}, key_store=store)) as server:
        yield server, f, backend


def test_a_changed_keys_file_adds_changes_and_revokes_keys_in_a_running_gateway(watched, caplog):
    server, f, backend = watched
    base = server.base
    assert ask(base, "sk-alice").status_code == 200
    assert ask(base, "sk-alice").status_code == 429  # 1 request a minute
    assert ask(base, "sk-bob").status_code == 200
    assert ask(base, "sk-carol").status_code == 401
    r = ask(base, "sk-bob", priority=-5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    before = reloads(base, "sk-bob", "ok")

    with caplog.at_level(logging.INFO, "swiftkv.keys"):
        write(f, [{"key": "sk-alice", "name": "alice", "limits": {"requests_per_minute": 100}},  # raised
                  {"key": "sk-carol", "name": "carol", "min_priority": -5},                     # added
                  {"sha256": digest("sk-dave"), "name": "dave", "share_prefix_cache": True}])   # bob revoked
        wait_until(lambda: ask(base, "sk-carol").status_code == 200, 10, "carol's key accepted")
    assert ask(base, "sk-bob").status_code == 401  # revoked: its next request
    assert ask(base, "sk-alice").status_code == 200  # the raised limit applies to the next request, no wait
    assert ask(base, "sk-carol", priority=-5).status_code == 200  # its min_priority
    assert ask(base, "sk-carol", priority=-6).status_code == 400
    assert reloads(base, "sk-carol", "ok") == before + 1
    assert metric(scrape(base, "sk-carol"), "swiftkv_api_keys") == 3
    assert "added 2 (carol, dave), revoked 1 (bob), changed 1 (alice)" in caplog.text
    assert "sk-alice" not in caplog.text and "sk-carol" not in caplog.text

    # per-key cache sharing: carol's cache is her own (the default), dave's is shared
    backend.requests.clear()
    assert ask(base, "sk-dave").status_code == 200 and ask(base, "sk-carol").status_code == 200
    dave, carol = backend.requests[-2:]
    assert dave.key_salt is None and carol.key_salt is not None

    # a lowered limit applies to the next request too: what is left of the bucket is capped at the new limit
    write(f, [{"key": "sk-alice", "limits": {"requests_per_minute": 1}}, {"key": "sk-carol"}])
    wait_until(lambda: ask(base, "sk-dave").status_code == 401, 10, "dave revoked")
    assert ask(base, "sk-alice").status_code == 200
    assert ask(base, "sk-alice").status_code == 429


def test_a_bad_keys_file_on_reload_keeps_the_old_keys(watched, caplog):
    server, f, _ = watched
    base = server.base
    failed = reloads(base, "sk-bob", "failed")
    with caplog.at_level(logging.ERROR, "swiftkv.keys"):
        f.write_text("keys:\n  - key: sk-bob\n    name: bob\n    limits: {requests_per_minute: zero}\n")
        wait_until(lambda: reloads(base, "sk-bob", "failed") == failed + 1, 10, "the failed reload counted")
    assert "keys[0] (bob).limits.requests_per_minute" in caplog.text and "not reloaded, the 2 keys loaded before stay" in caplog.text
    assert ask(base, "sk-bob").status_code == 200 and ask(base, "sk-alice").status_code == 200  # the old keys serve
    f.unlink()  # a missing file (a bad mount, a typo) is a failed reload too, not a revocation of every key
    wait_until(lambda: reloads(base, "sk-bob", "failed") == failed + 2, 10, "the missing file counted")
    assert ask(base, "sk-bob").status_code == 200
    write(f, [])  # an empty list revokes every key: the API stays closed
    wait_until(lambda: ask(base, "sk-bob").status_code == 401, 10, "every key revoked")
    assert ask(base, "anything").status_code == 401
    assert httpx.post(f"{base}/v1/chat/completions", json={"model": "m", "messages": HI}).status_code == 401


# ---- every worker of `swiftkv serve`, and the trainer ------------------------------------------------------------

@pytest.mark.slow
def test_sighup_reloads_the_keys_of_every_swiftkv_serve_worker(tiny_base, tmp_path):
    """`swiftkv serve --workers 2` whose pool is another gateway (in this process, over a fake engine): with the file's
    polling off (SWIFTKV_API_KEYS_RELOAD_SECONDS=0) a changed file changes nothing until SIGHUP to the parent, which
    forwards it to each worker; then both workers refuse the revoked key and take the added one."""
    upstream_cfg = platform_config(tiny_base, ("base",), data_dir=str(tmp_path / "up"), routing={"expose_reason": True})
    with ThreadedServer(InProcessGateway(upstream_cfg, {"base": FakeBackend("base", tokens=1)}, batch=False)) as upstream:
        f = tmp_path / "keys.yaml"
        write(f, [{"key": "sk-old", "name": "old"}])
        config = {"model": "front", "port": free_port(), "data_dir": str(tmp_path / "data"), "routing": {"share_prefix_cache": True},
                  "pools": {"base": {"backend": "remote", "url": f"{upstream.base}/v1", "model": str(tiny_base), "served_model_name": "m"}}}
        server = swiftkv_serve(tmp_path / "serve", config, "--engine", "inprocess", "--workers", "2", "--api-keys-file", str(f),
                               env={"SWIFTKV_API_KEYS_RELOAD_SECONDS": "0"})
        with server:
            server.start().wait(timeout=240)

            def statuses(key: str, n: int = 40) -> dict[str, set[int]]:
                """worker pid -> the statuses its answers to `key` had (a new connection per request)."""
                out: dict[str, set[int]] = {}
                for _ in range(n):
                    r = httpx.get(f"{server.base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
                    out.setdefault(r.headers["x-swiftkv-worker"], set()).add(r.status_code)
                return out

            assert all(s == {200} for s in statuses("sk-old").values())
            write(f, [{"key": "sk-new", "name": "new"}])
            time.sleep(1.0)
            assert all(s == {200} for s in statuses("sk-old", 10).values())  # no polling: nothing changed yet
            os.kill(server.proc.pid, signal.SIGHUP)

            def reloaded() -> bool:
                old, new = statuses("sk-old"), statuses("sk-new")
                return len(old) == 2 and all(s == {401} for s in old.values()) and all(s == {200} for s in new.values())

            wait_until(reloaded, 30, "every worker reloaded", server.proc, server.logs)
            assert server.proc.poll() is None  # SIGHUP stopped nothing
            r = httpx.post(f"{server.base}/v1/chat/completions", json={"model": "front", "messages": HI, "max_tokens": 2},
                           headers={"Authorization": "Bearer sk-new"}, timeout=30)
            assert r.status_code == 200, r.text
            assert server.logs().count("API keys reloaded from") >= 2  # once in each worker


@pytest.mark.slow
def test_the_trainer_follows_the_keys_file_and_sighup(tmp_path):
    trainer = Trainer(tmp_path, tmp_path / "data", tmp_path / "models", key="sk-one")
    f = tmp_path / "trainer-keys"
    trainer.env["SWIFTKV_API_KEYS_RELOAD_SECONDS"] = "0.2"

    def status(key: str) -> int:
        return httpx.get(f"{trainer.base}/v1/fine_tuning/jobs", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code

    with trainer:
        trainer.start()
        assert f.read_text() == "sk-one\n"  # the line format it was started with
        assert status("sk-one") == 200 and status("sk-two") == 401
        write(f, [{"key": "sk-two", "name": "two"}])  # the file changes: polled
        wait_until(lambda: status("sk-two") == 200, 10, "the new key accepted", trainer.proc, trainer.logs)
        assert status("sk-one") == 401
        f.write_text("keys:\n  - key: sk-two\n    limits: {requests_per_minute: 0}\n")  # bad: the old keys stay
        wait_until(lambda: metric(scrape(trainer.base), "swiftkv_api_key_reloads_total", result="failed") == 1, 10,
                   "the failed reload counted", trainer.proc, trainer.logs)
        assert status("sk-two") == 200
        write(f, [{"key": "sk-three"}])
        os.kill(trainer.proc.pid, signal.SIGHUP)  # at once, whatever the polling
        wait_until(lambda: status("sk-three") == 200, 10, "reloaded", trainer.proc, trainer.logs)
        assert status("sk-two") == 401 and trainer.proc.poll() is None
        assert "keys[0].limits.requests_per_minute" in trainer.logs()


# ---- the chart ---------------------------------------------------------------------------------------------------

def test_the_charts_keys_secret_is_a_keys_file_in_the_new_format():
    digest_b = digest("sk-b")
    docs = render(None, "--set", "apiKeys.keys[0]=sk-a", "--set", f"apiKeys.keys[1]=sha256:{digest_b}",
                  "--set", "apiKeys.keys[2].key=sk-c", "--set", "apiKeys.keys[2].name=team-c",
                  "--set", "apiKeys.keys[2].limits.requests_per_minute=60", "--set", "apiKeys.keys[2].min_priority=-10",
                  "--set", "apiKeys.keys[2].share_prefix_cache=true")
    (secret,) = find(docs, "Secret", "api-keys")
    text = secret["stringData"]["keys.txt"]
    assert not is_line_format(text)
    entries = {e.digest: e for e in parse_keys_file(text, "the chart's Secret")}
    assert set(entries) == {digest("sk-a"), digest_b, digest("sk-c")}
    c = entries[digest("sk-c")]
    assert (c.name, c.limit_values(), c.min_priority, c.share_prefix_cache) == ("team-c", {"requests_per_minute": 60}, -10, True)
    assert isinstance(c, KeyEntry)


@pytest.mark.parametrize("override,message", [
    (["--set", "apiKeys.keys[0]=sk-a requests_per_minute=60"], "apiKeys.keys.0: Does not match pattern"),  # a former line
    (["--set", "apiKeys.keys[0].name=a"], "apiKeys.keys.0"),  # neither key nor sha256
    (["--set", "apiKeys.keys[0].key=a", "--set", f"apiKeys.keys[0].sha256={'a' * 64}"], "apiKeys.keys.0"),  # both
    (["--set", "apiKeys.keys[0].key=a", "--set", "apiKeys.keys[0].limits.rpm=1"], "rpm"),
    (["--set", "apiKeys.keys[0].key=a", "--set", "apiKeys.keys[0].min_priority=1"], "apiKeys.keys.0.min_priority"),
])
def test_the_chart_refuses_a_key_entry_the_gateway_would(override, message):
    proc = run(tool("helm"), "template", "swiftkv", CHART, *override, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
