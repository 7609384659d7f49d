"""One rank of tests/test_ddp_groups.py: DDP over the groups --layout names (or, plain-*, no DDP and
a module of the rank's stage), then ddp_shards() written as JSON (or the DdpGroupError's message)."""
import argparse
import json

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from jitckpt.runtime.ddp_groups import DdpGroupError, ddp_shards

LAYOUTS = {  # world 4: each rank's DDP group
    "stages": [[0, 1], [0, 1], [2, 3], [2, 3]],
    "strided": [[0, 2], [1, 3], [0, 2], [1, 3]],
    "world": [[0, 1, 2, 3]] * 4,
    "mixed": [[0, 1], [0, 1], None, None],  # ranks 2 and 3 without DDP
}
PLAIN = {  # world 4, no DDP: each rank's stage (its module's seed and width)
    "plain-replicas": [0, 0, 0, 0],
    "plain-stages": [0, 0, 1, 1],  # the same shapes, other parameters
    "plain-pp": [0, 1, 2, 3],
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layout", choices=sorted(LAYOUTS) + sorted(PLAIN), required=True)
    p.add_argument("--out", required=True, help="a directory: each rank writes rank<r>.json there")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if a.layout in PLAIN:
        stage = PLAIN[a.layout][rank]
        torch.manual_seed(stage)
        model = torch.nn.Linear(2, 2 + stage // 2)
    else:
        layout = LAYOUTS[a.layout]
        groups = {tuple(g): dist.new_group(list(g)) for g in sorted({tuple(g) for g in layout if g})}
        mine = layout[rank]
        model = DDP(torch.nn.Linear(2, 2), process_group=groups[tuple(mine)]) if mine else torch.nn.Linear(2, 2)
    try:
        out = {"rank": rank, "shards": ddp_shards(torch.nn.Sequential(model))}
    except DdpGroupError as e:
        out = {"rank": rank, "error": str(e)}
    with open(f"{a.out}/rank{rank}.json", "w") as f:  # not stdout: torchrun interleaves the ranks' lines
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
