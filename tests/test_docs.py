"""The documentation's examples and generated reference pages stay true to the code. Code blocks in docs/**/*.md and
README.md are checked by what their fence and first line say:

- ```yaml whose first line is `# platform.yaml`: a whole platform config (`swiftkv serve --config`), validated by
  services.config.PlatformConfig.
- ```yaml whose first line is `# keys.yaml`: an API keys file (`--api-keys-file`), validated by
  services.common.keys.parse_keys_file.
- ```yaml whose first line is `# values.yaml`: Helm values for deploy/helm/swiftkv, merged over the chart's
  values.yaml as `helm install -f` merges them, then validated against its values.schema.json.
- ```bash, ```sh, ```shell and ```console (there, only lines starting with `$ `): every command line that runs
  `swiftkv` (or `.venv/bin/swiftkv`, after `$ ` and VAR=value) must name an existing subcommand and only options that
  subcommand takes; `\\` continuations are joined, and each command of `|`, `&&`, `||` and `;` is checked on its own.
  A block whose first line is `# not checked` is skipped (e.g. a removed command in the changelog).
- ```python whose first line is `# runs against the platform`: executed against the real gateway in this process over
  fake engines (tests/harness/gateway.py), served over HTTP. It serves the embedded default's model names
  (`swiftkv-smollm2`, `swiftkv-smollm2-swiftkv`, `swiftkv-smollm2-base`) with no API keys (any key works), the Batch
  and Files API included. `http://localhost:8000` and `http://127.0.0.1:8000` in the example become the gateway's
  address, and OPENAI_BASE_URL (that address + /v1) and OPENAI_API_KEY are set, so `openai.OpenAI()` works too. The
  fake engines answer `{}` to everything (one token), which tool-call and structured-output examples can parse.

The reference pages docs/generate writes (the site's GENERATED pages) must name every config field, Helm value,
route, metric and command of the code. `mkdocs build --strict` itself runs in CI (`make docs-build`), not here.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # docs.generate lives beside the packages, not installed with them
    sys.path.insert(0, str(ROOT))

from docs.generate import PAGES, cli, helm_values, http_api  # noqa: E402

PLATFORM_MARK, VALUES_MARK, PYTHON_MARK, SKIP_MARK = "# platform.yaml", "# values.yaml", "# runs against the platform", "# not checked"
KEYS_MARK = "# keys.yaml"
SHELLS = {"bash", "sh", "shell", "console"}
EXAMPLE_MODEL = "swiftkv-smollm2"  # the embedded default config's public name, which the examples use
EXAMPLE_ADDRESSES = ("http://localhost:8000", "http://127.0.0.1:8000")
# what the fake engines answer: the smallest JSON, so that examples parsing a constrained answer (tool-call arguments,
# structured output) parse it; fake engines follow no constraint
FAKE_ANSWER = {"tokens": 1, "text": "{}"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)")


@dataclass(frozen=True)
class Block:
    file: str
    line: int  # of the opening fence
    lang: str
    text: str

    @property
    def first_line(self) -> str:
        return self.text.split("\n", 1)[0].strip()

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, indentation (lists, admonitions) removed."""
    blocks, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        i += 1
        if not opening:
            continue
        indent, fence, body = len(opening["indent"]), opening["fence"], []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            line = lines[i]
            body.append(line[indent:] if line[:indent].strip() == "" else line.lstrip())
            i += 1
        blocks.append(Block(str(path.relative_to(ROOT)), i - len(body), opening["lang"].lower(), "\n".join(body)))
        i += 1
    return blocks


def doc_blocks(keep) -> list[Block]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [b for f in files if f.is_file() for b in fenced_blocks(f) if keep(b)]


def marked(lang: str, mark: str) -> list:
    return [pytest.param(b, id=str(b)) for b in doc_blocks(lambda b: b.lang == lang and b.first_line.startswith(mark))]


# ---- configuration examples ----------------------------------------------------------------------
@pytest.mark.parametrize("block", marked("yaml", PLATFORM_MARK))
def test_platform_yaml_examples_are_valid_configs(block):
    from services.config import PlatformConfig

    PlatformConfig.model_validate(yaml.safe_load(block.text))


@pytest.mark.parametrize("block", marked("yaml", KEYS_MARK))
def test_keys_yaml_examples_are_valid_keys_files(block):
    from services.common.keys import parse_keys_file

    assert parse_keys_file(block.text, str(block))


def helm_merge(base: dict, override: dict) -> dict:
    """`override` over `base` as Helm merges values files: maps key by key, anything else replaced, null deletes."""
    merged = dict(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            merged[key] = helm_merge(base[key], value)
        else:
            merged[key] = value
    return merged


@pytest.mark.parametrize("block", marked("yaml", VALUES_MARK))
def test_values_yaml_examples_meet_the_chart_schema(block):
    import jsonschema

    schema, defaults = helm_values.load()
    values = helm_merge(defaults, yaml.safe_load(block.text) or {})
    error = jsonschema.exceptions.best_match(jsonschema.Draft7Validator(schema).iter_errors(values))
    assert error is None, f"{block}: {'.'.join(map(str, error.path))}: {error.message}"


# ---- command lines -------------------------------------------------------------------------------
_SEPARATORS = {"|", "||", "&&", ";", "&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>"}
_ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=")
_RUNS_SWIFTKV = re.compile(r"(^|[\s/;&|(])swiftkv(\s|$)")


def command_lines(block: Block) -> list[str]:
    """The block's command lines, continuations joined (console: only those after a `$ ` prompt)."""
    lines = re.sub(r"\\\n", " ", block.text).splitlines()
    if block.lang == "console":
        return [ln[2:] for ln in lines if ln.startswith("$ ")]
    return [ln[2:] if ln.startswith("$ ") else ln for ln in lines]


def simple_commands(line: str) -> list[list[str]]:
    """The words of each command of a shell line: cut at pipes and && || ; &, comments and redirections dropped, and
    leading VAR=value assignments."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands, words, target = [], [], False
    for word in lexer:
        if word in _SEPARATORS:
            commands.append(words)
            words = []
        elif word in _REDIRECTS:
            target = True
        elif target:  # the file of a redirection
            target = False
        elif words or not _ASSIGNMENT.match(word):
            words.append(word)
    return [c for c in (*commands, words) if c]


def check_swiftkv_command(words: list[str]) -> str | None:
    """What is wrong with a `swiftkv ...` command line (None: nothing)."""
    command, path = cli.root_command(), [cli.PROGRAM]
    args = words[1:]
    while getattr(command, "commands", None) and args and not args[0].startswith("-"):
        if args[0] not in command.commands:
            return f"`{' '.join(path)}` has no command {args[0]!r} (it has {', '.join(command.commands)})"
        command = command.commands[args.pop(0)]
        path.append(command.name)
    known = cli.option_names(command)
    for arg in args:
        flag = arg.split("=", 1)[0]
        if re.match(r"^--?[A-Za-z]", flag) and flag not in known:
            return f"`{' '.join(path)}` has no option {flag} (it has {', '.join(sorted(known))})"
    return None


def swiftkv_problems(block: Block) -> list[str]:
    problems = []
    for line in filter(_RUNS_SWIFTKV.search, command_lines(block)):
        try:
            commands = simple_commands(line)
        except ValueError as e:  # unbalanced quotes
            problems.append(f"{line}: {e}")
            continue
        for words in commands:
            if words[0] == cli.PROGRAM or words[0].endswith("/" + cli.PROGRAM):
                problem = check_swiftkv_command(words)
                problems += [f"{shlex.join(words)}: {problem}"] if problem else []
    return problems


@pytest.mark.parametrize("block", [pytest.param(b, id=str(b)) for b in doc_blocks(
    lambda b: b.lang in SHELLS and b.first_line != SKIP_MARK and _RUNS_SWIFTKV.search(b.text))])
def test_swiftkv_command_lines_match_the_cli(block):
    assert not swiftkv_problems(block), "\n".join(swiftkv_problems(block))


def test_the_command_line_check_finds_what_is_wrong():
    """The checker itself: shell syntax cut right, a good line passes, an unknown command or option is named."""
    block = Block("x.md", 1, "console", '$ FOO=1 swiftkv serve --config p.yaml \\\n  --port 9000 | tee log > out && echo "a b"\nswiftkv x')
    assert [simple_commands(line) for line in command_lines(block)] == [
        [["swiftkv", "serve", "--config", "p.yaml", "--port", "9000"], ["tee", "log"], ["echo", "a b"]]]
    assert check_swiftkv_command(["swiftkv", "serve", "--config", "p.yaml", "--help"]) is None
    assert "no command 'serv'" in check_swiftkv_command(["swiftkv", "serv"])
    assert "no option --nope" in check_swiftkv_command(["swiftkv", "models", "prepare", "x", "--nope=1"])
    problems = swiftkv_problems(Block("x.md", 1, "bash", "swiftkv models prepare x --dir d\n.venv/bin/swiftkv serve --nope"))
    assert len(problems) == 1 and problems[0].startswith(".venv/bin/swiftkv serve --nope: `swiftkv serve` has no option --nope")


# ---- Python examples against the platform --------------------------------------------------------
@pytest.fixture(scope="module")
def example_gateway(tiny_base, tmp_path_factory):
    from harness import served_gateway

    with served_gateway(tiny_base, tmp_path_factory.mktemp("docs-examples"), max_model_len=4096, model=EXAMPLE_MODEL,
                        fake=FAKE_ANSWER) as server:
        yield server


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", marked("python", PYTHON_MARK))
def test_python_examples_run_against_the_platform(block, example_gateway, monkeypatch):
    source = block.text
    for address in EXAMPLE_ADDRESSES:
        source = source.replace(address, example_gateway.base)
    monkeypatch.setenv("OPENAI_BASE_URL", f"{example_gateway.base}/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-docs-example")
    exec(compile(source, str(block), "exec"), {"__name__": "__docs_example__"})


# ---- generated reference pages -------------------------------------------------------------------
@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return {path: write() for path, write in PAGES.items()}


def _code_spans(page: str) -> set[str]:
    return set(re.findall(r"`([^`\n]+)`", page))


def _json_schema_paths(schema: dict, node: dict, path: str = "") -> list[str]:
    """Every key path of a pydantic model's JSON schema: nested models and maps of models (as `<name>`) followed."""
    node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]] if "$ref" in node else node
    paths = []
    for name, prop in node.get("properties", {}).items():
        key = f"{path}.{name}" if path else name
        paths.append(key)
        for inner in (prop, *prop.get("anyOf", []), *prop.get("allOf", [])):
            paths += _json_schema_paths(schema, inner, key) if "$ref" in inner else []
        values = prop.get("additionalProperties")
        if isinstance(values, dict) and "$ref" in values:  # a map of models: pools.<name>
            paths += _json_schema_paths(schema, values, f"{key}.<name>")
    return paths


def test_config_page_names_every_field(pages):
    from services.config import PlatformConfig
    from services.serve import ServeSettings

    spans = _code_spans(pages["serving/config.md"])
    schema = PlatformConfig.model_json_schema()
    missing = [p for p in _json_schema_paths(schema, schema) if p not in spans]
    missing += [f"SWIFTKV_{name.upper()}" for name in ServeSettings.model_fields if f"SWIFTKV_{name.upper()}" not in spans]
    assert not missing, missing


def test_hyperparameters_page_names_every_field(pages):
    from services.training.hyperparameters import DistillationHyperparameters
    from services.training.service import TrainerSettings

    spans = _code_spans(pages["training/hyperparameters.md"])
    names = [*DistillationHyperparameters.model_fields, *(f"SWIFTKV_TRAINER_{n.upper()}" for n in TrainerSettings.model_fields)]
    missing = [n for n in names if n not in spans]
    assert not missing, missing


def test_http_api_page_names_every_route_and_error_code(pages):
    page = pages["serving/http-api.md"]
    for doc in (http_api.gateway_openapi(), http_api.trainer_openapi()):
        routes = [(m.upper(), p) for p, ops in doc["paths"].items() for m in ops]
        assert not [r for r in routes if f"| {r[0]} | `{r[1]}` |" not in page]
    # every literal `code="..."` of the gateway's sources (an independent, textual look at what the page's AST scan finds)
    sources = "\n".join(f.read_text() for d in http_api.ERROR_SOURCES for f in (ROOT / d).rglob("*.py"))
    codes = set(re.findall(r'\bcode="([a-z_]+)"', sources))
    assert codes and not [c for c in codes if f"`{c}`" not in page]
    assert all(s in page for s in ("x-swiftkv-route", "`priority`", '{"error": {"message"', "| `pinned` |"))


def test_helm_values_page_names_every_key(pages):
    schema, _ = helm_values.load()
    spans = _code_spans(pages["deploy/helm-values.md"])
    names, nodes = set(), [schema]
    while nodes:  # every property name at any depth appears as a step of some key path
        node = nodes.pop()
        if isinstance(node, dict):
            names.update(node.get("properties", {}))
            nodes += list(node.values())
    steps = {step for span in spans for step in span.split(".")}
    assert names and not names - steps, sorted(names - steps)


def test_metrics_page_names_every_metric(pages):
    page = pages["operations/metrics.md"]
    defined = [(kind, name) for f in (ROOT / "services").rglob("*.py")
               for kind, name in re.findall(r'\b(Counter|Gauge|Histogram|Summary)\(\s*"(\w+)"', f.read_text())]
    assert defined
    missing = [name for kind, name in defined if f"`{name}{'_total' if kind == 'Counter' else ''}`" not in page]
    assert not missing, f"{missing}: defined outside docs/generate/metrics.py METRIC_MODULES?"


def test_cli_page_names_every_command_and_option(pages):
    page = pages["cli.md"]
    for path, command in cli.commands():
        assert f"## `{' '.join(path)}`" in page
        for param in command.params:
            names = param.opts if param.param_type_name == "option" else [param.name.upper()]
            assert all(f"`{n}`" in page for n in names), (path, param.name)


def test_every_generated_page_says_so_and_is_not_a_file(pages):
    for path, text in pages.items():
        assert text.startswith("# ") and "Generated page" in text, path
        assert not (ROOT / "docs" / path).exists(), f"docs/{path} is generated at build time: delete the file"
