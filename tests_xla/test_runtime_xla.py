"""On torch-xla, ``init_distributed`` picks the ``xla`` backend and device, and a plain process
(no launcher) initialises without a fixed rendezvous port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import torch.distributed as dist

import neuron_ckpt as nc
from neuron_ckpt.distributed import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_xla_backend_device_and_process_group(xla):
    assert runtime.detect_backend() == "xla"
    assert (xla.backend, xla.rank, xla.world_size, xla.local_rank) == ("xla", 0, 1, 0)
    assert xla.device.type == "xla"
    assert runtime.is_xla()
    assert dist.get_backend() == "xla"
    st = nc.initialize_model_parallel(1)  # already initialised: returns the same state
    assert (st.tp.ranks, st.dp.ranks, st.tp.replica_groups) == ((0,), (0,), ((0,),))


def test_plain_process_does_not_need_the_default_rendezvous_port():
    # torch-xla's xla:// rendezvous defaults to localhost:12355; a second job on the host (or
    # anything else) holding that port must not break a single-process run.
    probe = textwrap.dedent(
        """
        import json, neuron_ckpt as nc
        rt = nc.init_distributed(timeout_s=60)
        nc.initialize_model_parallel(1)
        print(json.dumps(dict(backend=rt.backend, world=rt.world_size, device=rt.device.type)))
        nc.destroy_distributed()
        """
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""))
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", 12355))
            busy.listen()
        except OSError:
            pass  # already held by someone else: the run must cope all the same
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == dict(backend="xla", world=1, device="xla")
