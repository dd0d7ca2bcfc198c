"""Where a job's process runs: a child process on this machine (its own process group), or a Ray job
submitted through Ray's job submission API. Both are addressed by a reference string kept in the store,
so a restarted service finds (or restarts) the work of the one before it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

RUNNING = None  # poll() result while the work goes on


def job_command(run_dir: Path, python: str = sys.executable) -> list[str]:
    return [python, "-m", "services.training.job", str(run_dir)]


class LocalJobBackend:
    """One child per job, in a new session: cancel kills its whole group, and a kill -9 of the service leaves
    the child to finish its step (a restarted service follows it by pid, or restarts it from its checkpoint)."""

    def __init__(self):
        self.children: dict[int, subprocess.Popen] = {}  # for reaping only; the pid is in the store

    def start(self, job_id: str, run_dir: Path, attempt: int) -> str:
        log = open(run_dir / f"attempt-{attempt}.log", "wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(job_command(run_dir), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env, cwd=Path(__file__).resolve().parents[2])
        log.close()
        self.children[proc.pid] = proc
        return str(proc.pid)

    def _ours(self, pid: int, run_dir: Path) -> bool:
        """The pid is still this job's process (not a reused pid)."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return str(run_dir).encode() in cmdline

    def poll(self, ref: str, run_dir: Path) -> int | None:
        pid = int(ref)
        if pid in self.children:
            rc = self.children[pid].poll()
            if rc is not None:
                del self.children[pid]
            return rc
        # A child of an earlier service process: alive while /proc shows it, outcome read from the run folder.
        if self._ours(pid, run_dir):
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z":
                    return RUNNING
            except OSError:
                pass
        return 0 if (run_dir / "done").exists() else -1

    def stop(self, ref: str, run_dir: Path, timeout: float) -> None:
        """The service is stopping: SIGTERM asks the job to save its state at the end of its step and exit (the
        next start resumes it); past `timeout` it is killed and resumes from its last periodic checkpoint."""
        pid = int(ref)
        if not (pid in self.children or self._ours(pid, run_dir)):
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.poll(ref, run_dir) is RUNNING:
            time.sleep(0.2)
        if self.poll(ref, run_dir) is RUNNING:
            self.kill(ref, run_dir)

    def kill(self, ref: str, run_dir: Path) -> None:
        pid = int(ref)
        if pid in self.children or self._ours(pid, run_dir):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if pid in self.children:
                self.children.pop(pid).wait()

    def log_tail(self, ref: str, run_dir: Path, attempt: int) -> str:
        """The log's last 2000 bytes, read from there (a job may have written gigabytes)."""
        path = run_dir / f"attempt-{attempt}.log"
        if not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 2000))
            return f.read().decode(errors="replace")


class RayJobBackend:
    """Each attempt is a Ray job (`submission_id` = job id + attempt). The run folder must be on storage the
    cluster's workers share (the data dir on a shared volume); the entrypoint is the same module a local
    child runs, with the cluster's `python`."""

    def __init__(self, address: str, python: str = "python", num_gpus: float = 0, num_cpus: float = 1):
        self.address, self.python, self.num_gpus, self.num_cpus = address, python, num_gpus, num_cpus
        self._client = None

    @property
    def client(self):
        if self._client is None:
            from ray.job_submission import JobSubmissionClient

            self._client = JobSubmissionClient(self.address)
        return self._client

    def entrypoint(self, run_dir: Path) -> str:
        return shlex.join(job_command(run_dir, self.python))

    def submission(self, job_id: str, run_dir: Path, attempt: int) -> dict:
        kwargs = {"entrypoint": self.entrypoint(run_dir), "submission_id": f"{job_id}-{attempt}",
                  "metadata": {"swiftkv_job": job_id, "attempt": str(attempt)},
                  "entrypoint_num_cpus": self.num_cpus}
        if self.num_gpus:
            kwargs["entrypoint_num_gpus"] = self.num_gpus
        return kwargs

    def start(self, job_id: str, run_dir: Path, attempt: int) -> str:
        return self.client.submit_job(**self.submission(job_id, run_dir, attempt))

    def poll(self, ref: str, run_dir: Path) -> int | None:
        from ray.job_submission import JobStatus

        status = self.client.get_job_status(ref)
        if status == JobStatus.SUCCEEDED:
            return 0
        if status in (JobStatus.FAILED, JobStatus.STOPPED):
            return 1
        return RUNNING

    def stop(self, ref: str, run_dir: Path, timeout: float) -> None:
        """The service is stopping: the cluster keeps the job running, and the next start follows it."""

    def kill(self, ref: str, run_dir: Path) -> None:
        try:
            self.client.stop_job(ref)
        except Exception:  # already finished or unknown to the cluster: nothing left to stop
            pass

    def log_tail(self, ref: str, run_dir: Path, attempt: int) -> str:
        try:
            return self.client.get_job_logs(ref)[-2000:]
        except Exception as e:
            return f"logs unavailable: {e}"
