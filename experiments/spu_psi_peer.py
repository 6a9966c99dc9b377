"""One party of SecretFlow's two-party PSI (``spu.psi.psi_execute``), for ``bench_psi.py``.

Run with the Python of a venv holding ``spu`` (``pip install spu``; it is not a dependency of
fl_split): ``python spu_psi_peer.py RANK PORT0 PORT1 PROTOCOL IN.csv OUT.csv``. Both ranks talk
over brpc on the loopback (one process each, as two organisations would run it); prints one JSON
line: the seconds ``psi_execute`` took at this rank, the CPU seconds and peak resident memory of the
process, and its report's counts."""

import json
import resource
import sys
import time

from spu import psi
from spu.libspu import link

rank, port0, port1, protocol, src, dst = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], sys.argv[6]
desc = link.Desc()
desc.id = "fl_split-bench"
desc.recv_timeout_ms = 600_000
desc.http_timeout_ms = 600_000
desc.add_party("alice", f"127.0.0.1:{port0}")
desc.add_party("bob", f"127.0.0.1:{port1}")
lctx = link.create_brpc(desc, rank)
proto = psi.PsiProtocolConfig(
    protocol={"ecdh": psi.PsiProtocol.PROTOCOL_ECDH, "rr22": psi.PsiProtocol.PROTOCOL_RR22}[protocol],
    receiver_rank=0, broadcast_result=True,
    ecdh_params=psi.EcdhParams(curve=psi.EllipticCurveType.CURVE_25519))
config = psi.PsiExecuteConfig(
    protocol_conf=proto,
    input_params=psi.InputParams(type=psi.SourceType.SOURCE_TYPE_FILE_CSV, path=src, selected_keys=["id"],
                                 keys_unique=True),
    output_params=psi.OutputParams(type=psi.SourceType.SOURCE_TYPE_FILE_CSV, path=dst, disable_alignment=True),
    join_conf=psi.ResultJoinConfig(type=psi.ResultJoinType.JOIN_TYPE_INNER_JOIN))
t0 = time.perf_counter()
report = psi.psi_execute(config, lctx)
dt = time.perf_counter() - t0
use = resource.getrusage(resource.RUSAGE_SELF)
lctx.stop_link()
print("SPU_RESULT " + json.dumps({"rank": rank, "seconds": dt, "cpu_s": use.ru_utime + use.ru_stime,
                                  "peak_rss_mb": use.ru_maxrss / 1024, "original": report.original_count,
                  "intersection": report.intersection_count}))
