"""The documentation's reference pages, generated from the code at build time (docs/hooks.py adds them to the site)
so they cannot drift from it: page path under docs/ -> the function that writes its Markdown."""

from __future__ import annotations

from typing import Callable

from .cli import cli_page
from .helm_values import helm_values_page
from .http_api import http_api_page
from .metrics import metrics_page
from .settings import config_page, hyperparameters_page

PAGES: dict[str, Callable[[], str]] = {
    "serving/config.md": config_page,
    "serving/http-api.md": http_api_page,
    "training/hyperparameters.md": hyperparameters_page,
    "deploy/helm-values.md": helm_values_page,
    "operations/metrics.md": metrics_page,
    "cli.md": cli_page,
}
