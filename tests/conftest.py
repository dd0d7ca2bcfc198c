"""Shared fixtures: tiny checkpoints are built once per test session (no downloads, a few seconds), and the real
engines the `engine` tests share are started once per run: `platform` (one `swiftkv serve --engine inprocess` with two
pools) and `vllm_server` (vLLM's own OpenAI server) when the run starts, where some collected test uses them, so their
start-up (half a minute each on two cores) overlaps the modules that need neither, which run first;
`offline_engines` (vLLM's offline LLM, one at a time) on first use. Tests marked `last` run after every other test,
in the order their marker gives: they kill an engine of the shared platform, then stop it.

Under pytest-xdist (`make test` runs two workers: the suite leaves about half of two cores idle, waiting on engine
start-ups, processes and sockets) a module is one unit of work, except the modules of UNITS: "shared" (those using the
shared servers, or marked `shares("redis")`: the Redis every machine runs, db 0) runs in order on one worker, which
starts the shared servers at its first test, and "ray" (marked `shares("ray")`: one Ray cluster at a time on two cores)
on one worker too. They are handed out first, in UNITS's order, then the other modules, heaviest first. The scheduler
sees test ids only, hence the table; collection checks it against the fixtures and markers."""

from __future__ import annotations

import os
import shutil
from collections import defaultdict
from pathlib import Path

# Tests never reach a model hub: everything they load is built locally (here, or by `models prepare`).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
from harness.engines import OfflineEngines, launch_platform, launch_vllm_server, platform_ready
from harness.postgres import fresh_postgres_database

from swiftkv_core.convert import convert
from swiftkv_core.tiny import build_tiny_llama, perturb_swiftkv

# 8 layers so l = 4 skips half and AcrossKV groups of 2 and 4 divide L - l.
TINY_LAYERS = 8


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-base"), num_hidden_layers=TINY_LAYERS)


@pytest.fixture(scope="session")
def tiny_swiftkv_undistilled(tiny_base, tmp_path_factory) -> Path:
    """l = 4 of 8 (SingleInputKV only), straight from the converter: SwiftKV tensors copied from the base."""
    return convert(str(tiny_base), tmp_path_factory.mktemp("tiny-swiftkv-undistilled"), num_key_value_layers=4)


@pytest.fixture(scope="session")
def tiny_swiftkv_across_undistilled(tiny_base, tmp_path_factory) -> Path:
    """l = 4 of 8 with 2-way AcrossKV, straight from the converter."""
    return convert(str(tiny_base), tmp_path_factory.mktemp("tiny-swiftkv-across-undistilled"), num_key_value_layers=4, key_value_group_size=2)


def _perturbed_copy(src: Path, tmp_path_factory, name: str) -> Path:
    dest = tmp_path_factory.mktemp(name) / "model"
    shutil.copytree(src, dest)
    return perturb_swiftkv(dest)


@pytest.fixture(scope="session")
def tiny_swiftkv(tiny_swiftkv_undistilled, tmp_path_factory) -> Path:
    """l = 4 of 8 (SingleInputKV only), every SwiftKV tensor perturbed like a distilled one, so each differs
    from the base tensor it was initialised from (parity then checks that each one is loaded right)."""
    return _perturbed_copy(tiny_swiftkv_undistilled, tmp_path_factory, "tiny-swiftkv")


@pytest.fixture(scope="session")
def tiny_swiftkv_across(tiny_swiftkv_across_undistilled, tmp_path_factory) -> Path:
    """l = 4 of 8 with 2-way AcrossKV, SwiftKV tensors perturbed."""
    return _perturbed_copy(tiny_swiftkv_across_undistilled, tmp_path_factory, "tiny-swiftkv-across")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct, prepared offline into ./models (cached across sessions)."""
    from swiftkv_core.catalog import prepare

    return prepare("smollm2-135m-instruct", Path(__file__).resolve().parent.parent / "models")


@pytest.fixture(scope="module")
def pg_url():
    """A fresh PostgreSQL database for one test module."""
    with fresh_postgres_database("swiftkv_test") as url:
        yield url


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """Real held-out text for the load-test tools' workloads: 20 man pages as `swiftkv data prepare` writes them."""
    from swiftkv_core import data

    path = tmp_path_factory.mktemp("corpus") / data.MANPAGES_FILE
    data.prepare_manpages(path, pages=20)
    return path


@pytest.fixture(scope="session")
def tokenizer(tiny_base):
    """The tiny checkpoints' tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_base)


TRAIN_TEXT = (
    "SwiftKV computes the key value cache of the later layers from an earlier layer. "
    "The quick brown fox jumps over the lazy dog. The capital of France is Paris. "
    "def add(a, b):\n    return a + b\n"
) * 40


@pytest.fixture(scope="session")
def train_text(tmp_path_factory) -> Path:
    """A small training text for distillation runs on the tiny fixture."""
    path = tmp_path_factory.mktemp("data") / "train.txt"
    path.write_text(TRAIN_TEXT)
    return path


# ---- real engines, shared by the whole run ------------------------------------------------------------
SHARED_SERVERS = ("platform", "vllm_server")


def xdist_worker(config) -> bool:
    return hasattr(config, "workerinput")


class SharedServers:
    """The shared servers some collected test uses, launched together (`launch`), stopped at the end."""

    def __init__(self, request, tmp_path_factory):
        self.request, self.tmp = request, tmp_path_factory
        self.used = {name for item in request.session.items for name in SHARED_SERVERS if name in item.fixturenames}
        self.servers: dict = {}

    def launch(self) -> None:
        tiny_base = self.request.getfixturevalue("tiny_base")
        if "platform" in self.used and "platform" not in self.servers:
            self.servers["platform"] = launch_platform(tiny_base, self.request.getfixturevalue("tiny_swiftkv"), self.tmp.mktemp("platform"))
        if "vllm_server" in self.used and "vllm_server" not in self.servers:
            self.servers["vllm_server"] = launch_vllm_server(tiny_base, self.tmp.mktemp("vllm-server"))

    def __getitem__(self, name: str):
        self.launch()
        return self.servers[name]

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="session", autouse=True)
def shared_servers(request, tmp_path_factory):
    """Launched before the first test runs, so their start-up overlaps the modules that need neither; under xdist,
    by the worker that runs the shared unit, at its first test (every worker collects every test)."""
    servers = SharedServers(request, tmp_path_factory)
    try:
        if not xdist_worker(request.config):
            servers.launch()
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="session")
def platform(shared_servers):
    """The shared `swiftkv serve --engine inprocess` (harness.engines.platform_config), ready."""
    return platform_ready(shared_servers["platform"])


@pytest.fixture(scope="session")
def vllm_server(shared_servers):
    """Base URL of vLLM's OpenAI server on the tiny base model (harness.engines.launch_vllm_server), ready."""
    return shared_servers["vllm_server"].wait().base


@pytest.fixture(scope="session")
def offline_engines():
    """vLLM's offline engines on the tiny checkpoints, one alive at a time (harness.engines.OfflineEngines): the one a
    module leaves running serves the next module that asks for the same engine."""
    engines = OfflineEngines()
    try:
        yield engines
    finally:
        engines.close()


# Under xdist: the modules that run one after another on one worker, each unit handed out in this order.
UNITS = {
    "shared": ("test_batch.py", "test_bench_target.py", "test_deploy_live.py", "test_gateway.py", "test_gateway_hostile.py",
               "test_openai_compat.py", "test_quiet_start.py", "test_reliability.py", "test_remote_backend.py", "test_replicas.py",
               "test_workers.py", "test_keys_redis.py", "test_cached_tokens.py", "test_responses_engine.py"),
    "ray": ("test_serve_ray.py", "test_serve_ray_attach.py"),
}


def unit_of(module: str) -> str:
    return next((unit for unit, modules in UNITS.items() if module in modules), module)


@pytest.hookimpl(optionalhook=True)  # no such hook without xdist (TEST_WORKERS=0)
def pytest_xdist_make_scheduler(config, log):
    """Work units by UNITS (xdist's own xdist_group marks rename test ids, which pytest 9 no longer reads)."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid.split("::")[0].rsplit("/", 1)[-1])

    # Units go out in the collection's order (pytest_collection_modifyitems: the heaviest first), not xdist's default
    # of the most tests first, which left the few-test modules that start their own engines to the end of the run.
    config.option.loadscopereorder = False
    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Modules that use no shared server first (the shared servers start meanwhile), then the others, each module's
    tests in their order; tests marked `last(n)` after all others, by n: the shared platform serves every engine test
    before them. Under xdist the units of UNITS come first instead, in its order (the other worker takes the rest
    meanwhile)."""
    needs = defaultdict(set)  # by module file: the shared servers and machine-wide resources its tests use
    for item in items:
        needs[item.path.name] |= {m.args[0] for m in item.iter_markers("shares")} | set(SHARED_SERVERS).intersection(item.fixturenames)
    for module, used in needs.items():
        unit = "shared" if used - {"ray"} else "ray" if used else module
        if unit_of(module) != unit:
            raise pytest.UsageError(f"tests/conftest.py UNITS: {module} uses {', '.join(sorted(used)) or 'nothing shared'}, so it "
                                    f"belongs to {'unit ' + repr(unit) if unit != module else 'no unit'}")
    parallel = xdist_worker(config)
    rank = {unit: i for i, unit in enumerate(UNITS)}
    # The other modules, heaviest first (most engine tests, then slow ones, then tests): the last ones handed out
    # are then short, and neither worker waits long on the other at the end.
    weight: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for item in items:
        w = weight[item.path.name]
        w[0] -= item.get_closest_marker("engine") is not None
        w[1] -= item.get_closest_marker("slow") is not None
        w[2] -= 1

    def order(item):
        mark = item.get_closest_marker("last")
        if mark is not None:
            return (1, 0, (), mark.args[0] if mark.args else 0)
        if parallel:
            unit = unit_of(item.path.name)
            return (0, rank.get(unit, len(rank)), tuple(weight[item.path.name]) if unit not in rank else (), 0)
        return (0, unit_of(item.path.name) == "shared", (), 0)

    items.sort(key=order)  # stable: the order within each group stays
