"""A two-node Slurm cluster on this machine, for testing the sbatch templates.

Debian's slurm-wlm is built with MULTIPLE_SLURMD, so two slurmd daemons (n1, n2) on one
host make two nodes. Both have NodeAddr 127.0.0.1, which is what the templates read for
the head node's address. munged needs a key in /etc/munge; a key is created if missing.

AuthInfo=cred_expire=10: a requeued job waits out its old credentials' lifetime before it may
start again (Slurm sets its BeginTime that far ahead; the default is 120 s). Starting it sooner,
e.g. with `scontrol update StartTime=now`, fails it: "Job credential revoked". A BeginTime that
passes wakes no scheduler; bf_interval=1 has the backfill pass find the job within a second
(default 30 s).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "srun", "scontrol", "munged"]


def missing_reason() -> str | None:
    """Why a cluster cannot be started here (None if it can), installing Slurm if allowed."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return (
            "Slurm is not installed and cannot be installed here (needs root and apt-get: " + " ".join(PACKAGES) + ")"
        )
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], env=env, capture_output=True, text=True)
    if install.returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        install = subprocess.run(
            ["apt-get", "install", "-y", "-qq", *PACKAGES], env=env, capture_output=True, text=True
        )
    if install.returncode != 0:
        return f"apt-get could not install Slurm: {install.stderr.strip()[-300:]}"
    return None if all(shutil.which(b) for b in BINARIES) else "Slurm binaries missing after install"


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class LocalSlurm:
    def __init__(self, root: Path, cpus_per_node: int = 1):
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.started_munge = False
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        host = socket.gethostname()
        ctld_port, n1_port, n2_port = _free_ports(3)
        for d in ("state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""\
ClusterName=llmtrain-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
InactiveLimit=0
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs={cpus_per_node} State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs={cpus_per_node} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _ensure_munge(self) -> None:
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            key.parent.mkdir(parents=True, exist_ok=True)
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
        if subprocess.run(["munge", "-n"], capture_output=True).returncode != 0:
            subprocess.run(["munged", "--force"], check=True, capture_output=True)
            self.started_munge = True
            time.sleep(0.5)

    def start(self) -> None:
        self._ensure_munge()
        self.procs.append(
            subprocess.Popen(
                ["slurmctld", "-D", "-i", "-f", str(self.conf)],
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        time.sleep(1)
        for node in ("n1", "n2"):
            self.procs.append(
                subprocess.Popen(
                    ["slurmd", "-D", "-N", node, "-f", str(self.conf)],
                    env=self.env,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        deadline = time.time() + 60
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-N", "-o", "%N %t").stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if states.get("n1") == "idle" and states.get("n2") == "idle":
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"Slurm nodes did not come up: {out}\n{(self.root / 'log' / 'slurmctld.log').read_text()[-2000:]}"
        )

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, **kw)

    def stop(self) -> None:
        self.run("scancel", "--full", "--user=root")
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.started_munge:
            subprocess.run(["pkill", "-x", "munged"], capture_output=True)

    def job_state(self, job_id: str) -> dict:
        out = self.run("scontrol", "show", "job", "-o", job_id).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait(self, job_id: str, timeout: float = 300) -> dict:
        """Wait until the job has ended; returns its final scontrol fields."""
        deadline = time.time() + timeout
        state = {}
        while time.time() < deadline:
            state = self.job_state(job_id)
            if state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {state.get('JobState')} after {timeout}s")
