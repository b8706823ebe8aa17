"""A real one-node SLURM cluster on this machine, for tests: ``munged``, ``slurmctld`` and ``slurmd`` started as
plain processes (no systemd), with their key, configuration, state, spool, sockets and logs in one folder.

The node is this host with its CPUs, ``proctrack/linuxproc`` and no cgroups. The daemons listen on free ports
and munge on its own socket, so the cluster touches nothing of the machine's own SLURM or munge. Clients find
it through ``SLURM_CONF`` in ``env``. ``stop`` cancels the jobs submitted through ``sbatch`` and ends exactly
the daemons started here, by their process ids.
"""

from __future__ import annotations

import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from rank_runner import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "sinfo", "srun", "scancel")


def missing_programs() -> list[str]:
    """The daemons and clients this machine lacks (``.ci/run`` installs them: slurmctld slurmd slurm-client
    munge)."""
    return [name for name in (*DAEMONS, *CLIENTS) if shutil.which(name) is None]


class SlurmCluster:
    """Start with ``start()``; submit with ``sbatch``; read a job with ``job``; end with ``stop()``."""

    def __init__(self, folder: Path, cpus: int | None = None) -> None:
        self.folder = folder
        self.cpus = cpus or len(os.sched_getaffinity(0))
        self.host = socket.gethostname()
        self.conf = folder / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen] = []
        self._jobs: list[str] = []

    def start(self, timeout: float = 60) -> None:
        self.folder.chmod(0o755)  # munged wants its socket's folder searchable by every user
        for sub in ("state", "spool"):
            (self.folder / sub).mkdir()
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = self.folder / "munge.socket"
        self._start("munged", "-F", "--force", f"--key-file={key}", f"--socket={socket_path}",
                    f"--pid-file={self.folder / 'munged.pid'}", f"--seed-file={self.folder / 'munged.seed'}",
                    f"--log-file={self.folder / 'munged.log'}")
        wait_for(socket_path.exists, timeout, "munged did not create its socket", self._logs)
        self.conf.write_text(self._configuration(socket_path))
        self._start("slurmctld", "-D", "-f", str(self.conf))
        self._start("slurmd", "-D", "-f", str(self.conf))
        wait_for(lambda: self._node_state() == "idle", timeout, "the node did not become idle", self._logs)

    def sbatch(self, *args: str, cwd: Path, env: dict[str, str]) -> str:
        """Submit a batch job; returns its id."""
        result = self._run("sbatch", "--parsable", *args, cwd=cwd, env={**env, "SLURM_CONF": str(self.conf)})
        job = result.split(";")[0]
        self._jobs.append(job)
        return job

    def job(self, job: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, RunTime, ...); none once SLURM has
        forgotten the job."""
        result = subprocess.run(["scontrol", "show", "job", "--oneliner", job], env=self.env, capture_output=True,
                                text=True, timeout=30)
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout)) if result.returncode == 0 else {}

    def scontrol(self, *args: str) -> str:
        return self._run("scontrol", *args)

    def stop(self) -> None:
        if self._jobs:
            subprocess.run(["scancel", *self._jobs], env=self.env, capture_output=True, timeout=30)
            wait_for(lambda: all(self.job(j).get("JobState") not in _ALIVE for j in self._jobs), 60,
                     "cancelled jobs still alive", self._logs, fail=False)
        for daemon in reversed(self._daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()

    def _configuration(self, munge_socket: Path) -> str:
        user, f = getpass.getuser(), self.folder
        return "\n".join([
            "ClusterName=sparsebalance-test",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge_socket}",
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "JobRequeue=1",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool'}",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'slurmd.pid'}",
            f"SlurmctldLogFile={f / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'slurmd.log'}",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ])

    def _start(self, name: str, *args: str) -> None:
        out = open(self.folder / f"{name}.out", "w")
        self._daemons.append(subprocess.Popen([name, *args], stdout=out, stderr=subprocess.STDOUT, env=self.env))

    def _node_state(self) -> str:
        result = subprocess.run(["sinfo", "-h", "-n", self.host, "-o", "%T"], env=self.env, capture_output=True,
                                text=True, timeout=30)
        return result.stdout.strip()

    def _run(self, *command: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        result = subprocess.run(command, cwd=cwd, env=env or self.env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit code {result.returncode}: {result.stderr.strip()}")
        return result.stdout.strip()

    def _logs(self) -> str:
        """The end of every daemon's output, and whether it is still running, for a failure's message."""
        parts = []
        for daemon in self._daemons:
            name = daemon.args[0]
            state = "running" if daemon.poll() is None else f"exited with {daemon.returncode}"
            tail = (self.folder / f"{name}.out").read_text()[-1500:]
            parts.append(f"--- {name} ({state}):\n{tail}")
        return "\n".join(parts)


_ALIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "SUSPENDED")


def wait_for(condition, timeout: float, what: str, details, fail: bool = True) -> bool:
    """Polls ``condition`` every half second; past ``timeout``, raises with ``what`` and ``details()`` (or
    returns False when not ``fail``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.5)
    if fail:
        raise TimeoutError(f"{what} within {timeout} s\n{details()}")
    return False
