"""What several test modules share: free ports, server processes started and waited for one way, Prometheus
scrapes, the one fake backend (services.serving.fake), the real gateway app in-process (`served_gateway` for a
module's served gateway), the tiny engines' settings, and the helpers of the batch, training and deployment tests.
Test modules import from here, never from each other."""

from services.serving.fake import FakeBackend

from .gateway import served_gateway
from .metrics import metric, scrape
from .processes import HTTP_TIMEOUT, Server, free_port, swiftkv_serve, vllm_openai_server, wait_until

__all__ = ["HTTP_TIMEOUT", "FakeBackend", "Server", "free_port", "metric", "scrape", "served_gateway", "swiftkv_serve", "vllm_openai_server",
           "wait_until"]
