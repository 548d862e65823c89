"""`zeropp plan --framework fsdp2`'s bytes are what zeropp.torch.ByteCounter
counts in a real run (`cargo xtask torch test`).

Under torchrun as 2 nodes x 2 (ZEROPP_LOCAL_SIZE=2), for two Hugging Face
``LlamaForCausalLM`` shapes and every mode of the planner (``fsdp2``:
``reshard_after_forward=True``; ``fsdp2-hpz``: ``reshard_after_forward=2``;
``zeropp-torch``: the README's recipe, ``zeropp.torch.enable``), with
``fully_shard`` on every decoder layer and on the root: one forward and
backward is counted on every rank, after two warm-up steps (FSDP2's lazy init;
and qgZ's default rotation measures the gradients at its calls 1, 2, 4, ...
with one small all-reduce that the plan leaves out, so the counted step is
call 3),
and rank 0 runs ``zeropp plan --framework fsdp2 --json`` (the binary given as
the first argument) for the same job. Every rank's intra- and inter-node
bytes must equal the plan's, to the byte.

The jobs differ where the byte model has a case: the first is a ``llama:``
spec, bf16 gathers and reduces, dims that the world does not divide (the
vocabulary, the key/value rows); the second is read from its own
``config.json`` (``--hf-config``), with GQA, attention and MLP biases (1-D
parameters zeropp sends exactly), tied embeddings, fp32 reduces and the root
resharded; the third is the first on one node of 4 ranks, fp32 throughout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zeropp.torch as zt

SMALL = dict(vocab_size=1001, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)
SMALL_SPEC = ["--model", "llama:d=64,layers=2,heads=4,kv_heads=2,ff=176,vocab=1001"]
SHAPES = [
    # (name, LlamaConfig keywords, the planner's model flags, (param, reduce) dtypes, the root
    # given reshard_after_forward, ranks per node)
    ("llama spec, bf16, root at FSDP2's default, 2 x 2", SMALL, SMALL_SPEC, (torch.bfloat16, torch.bfloat16),
     False, 2),
    ("hf config, biases, tied, bf16 gathers, fp32 reduces, root resharded, 2 x 2",
     dict(vocab_size=777, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
          num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
     None, (torch.bfloat16, torch.float32), True, 2),
    # One node: every call is torch's own, zeropp's included; fp32 everywhere.
    ("llama spec, fp32, one node of 4", SMALL, SMALL_SPEC, (torch.float32, torch.float32), False, 4),
]
MODES = ("fsdp2", "fsdp2-hpz", "zeropp-torch")
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
SEQ = 16


def counted(cfg_kw: dict, mode: str, dtypes, root_reshards: bool, ls: int):
    """(inter, intra) bytes this rank hands torch.distributed in one forward
    and backward of the shape under ``mode``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg_kw))
    mp = MixedPrecisionPolicy(param_dtype=dtypes[0], reduce_dtype=dtypes[1])
    reshard = ls if mode == "fsdp2-hpz" else True
    for layer in model.model.layers:
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=mp)
    if root_reshards:
        fully_shard(model, reshard_after_forward=reshard, mp_policy=mp)
    else:
        fully_shard(model, mp_policy=mp)
    if mode == "zeropp-torch":
        zt.enable(model, local_size=ls)
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randint(0, cfg_kw["vocab_size"], (1, SEQ), generator=gen)
    # Warm-up: FSDP2's lazy init, and the rotation's measures at calls 1 and 2, outside the count.
    for _ in range(2):
        model(input_ids=x, labels=x).loss.backward()
    with zt.ByteCounter(ls) as bc:
        model(input_ids=x, labels=x).loss.backward()
    if mode == "zeropp-torch":
        zt.release()
    return bc.inter, bc.intra


def planned(binary: str, flags: list, dtypes, root_reshards: bool, ls: int) -> dict:
    """mode -> (inter, intra) bytes per GPU per step, from `zeropp plan --json`."""
    cmd = [binary, "plan", "--framework", "fsdp2", *flags, "--seq", str(SEQ), "--tokens", str(SEQ),
           "--nodes", str(4 // ls), "--gpus-per-node", str(ls), "--intra", "10GB/s", "--gpu", "tflops=1",
           "--param-dtype", NAMES[dtypes[0]], "--reduce-dtype", NAMES[dtypes[1]],
           "--mode", ",".join(MODES), "--json"] + (["--root-reshard"] if root_reshards else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    plan = json.loads(out)
    return {m: (plan["modes"][m]["inter_node_bytes"], plan["modes"][m]["intra_node_bytes"]) for m in MODES}


def main():
    binary = sys.argv[1]
    dist.init_process_group("gloo")
    if dist.get_world_size() != 4 or zt.local_size() != 2:
        raise SystemExit("plan_bytes.py runs as 2 nodes x 2 (torchrun --nproc-per-node 4, ZEROPP_LOCAL_SIZE=2)")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg_kw, flags, dtypes, root_reshards, ls in SHAPES:
            if flags is None:
                from transformers import LlamaConfig

                path = os.path.join(tmp, "config.json")
                if dist.get_rank() == 0:
                    LlamaConfig(**cfg_kw).to_json_file(path)
                flags = ["--hf-config", path]
            want = planned(binary, flags, dtypes, root_reshards, ls) if dist.get_rank() == 0 else None
            for mode in MODES:
                got = counted(cfg_kw, mode, dtypes, root_reshards, ls)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, got)
                if dist.get_rank() == 0:
                    plan = tuple(int(b) for b in want[mode])
                    ok = all(tuple(g) == plan for g in every)
                    line = (f"{name}, {mode}: planned (inter, intra) {plan}, counted per rank {every}")
                    print(("ok   " if ok else "FAIL ") + line, flush=True)
                    if not ok:
                        failures.append(line)
    verdict = [failures]
    dist.broadcast_object_list(verdict, src=0)
    dist.barrier()
    dist.destroy_process_group()
    if verdict[0]:
        print(f"plan_bytes: {len(verdict[0])} of {len(SHAPES) * len(MODES)} jobs differ from the plan",
              file=sys.stderr)
        sys.exit(1)
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"plan_bytes: the plan's bytes are ByteCounter's for {len(SHAPES)} shapes x {len(MODES)} modes")


if __name__ == "__main__":
    main()
