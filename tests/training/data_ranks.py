"""``torchrun --nproc_per_node 4 tests/training/data_ranks.py OUT_DIR``: each process sets a context degree of 2
(:func:`flowgrpo.distributed.dist.set_context_degree`) and writes ``OUT_DIR/rank_<global rank>.json`` with what
:mod:`flowgrpo.distributed.dist` gives it: ``data_rank``, ``data_world_size``, ``slice`` (its share of 8 items),
``gathered``
(:func:`~flowgrpo.distributed.dist.gather_cat` of ``[10·data_rank + 1]``), ``summed``
(:func:`~flowgrpo.distributed.dist.all_reduce_sum`
of ``[1, data_rank]``), and ``refused`` (the message of ``set_context_degree(3)``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed  # noqa: E402

from flowgrpo.distributed import dist  # noqa: E402

if __name__ == "__main__":
    torch.distributed.init_process_group("gloo")
    try:
        dist.set_context_degree(3)
        refused = ""
    except ValueError as err:
        refused = str(err)
    dist.set_context_degree(2)
    share = dist.local_slice(8)
    out = {"data_rank": dist.data_rank(), "data_world_size": dist.data_world_size(),
           "slice": [share.start, share.stop],
           "gathered": dist.gather_cat(torch.tensor([10.0 * dist.data_rank() + 1])).tolist(),
           "summed": dist.all_reduce_sum(torch.tensor([1.0, dist.data_rank()])).tolist(), "refused": refused}
    Path(sys.argv[1], f"rank_{dist.rank()}.json").write_text(json.dumps(out))
    torch.distributed.destroy_process_group()
