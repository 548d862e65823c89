//! The memory per GPU of a PyTorch job under FSDP2 ([`memory`]): the sharded
//! states, the gathered modules, what an hpZ keeps, and the activations a
//! Hugging Face Llama layer's graph keeps, checked against tracked peaks by
//! `cargo xtask bench plan` (docs/PERFORMANCE.md, "FSDP2's memory per GPU
//! against a tracked peak").

use zeropp_quant::{QuantSpec, encoded_len};

use super::decoder::{Decoder, Param};
use super::torch_job::{Sharding, TorchMode};
use crate::Result;

/// An FSDP2 job's bytes per GPU at its peak, by part.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct TorchMemory {
    /// The sharded states: fp32 parameters, fp32 gradients and AdamW's two
    /// fp32 moments, 16 bytes an element of the rank's padded shards.
    pub states: f64,
    /// The root's parameters in the parameters' dtype and their unsharded
    /// gradient in the reduce dtype, held from its forward to the end of the
    /// backward unless it reshards ([`Sharding::root_reshards`]);
    /// 0 when it does (then a layer in flight bounds it: the root's gather is
    /// counted in `in_flight` when it is the larger).
    pub root: f64,
    /// Two modules gathered at once (the one computing and the one
    /// prefetched: two decoder layers, or a layer and a resharding root), and
    /// one layer's unsharded gradient in the reduce dtype.
    pub in_flight: f64,
    /// What an hpZ keeps from the forward for the backward, every layer at
    /// the end of the forward: FSDP2's `W/L`-shard in the parameters' dtype,
    /// or zeropp's node share of the INT8 encodings.
    pub hpz: f64,
    /// Activations in the parameters' dtype: what each decoder layer's graph
    /// keeps for its backward (`Decoder::layer_activation_bytes`: `41.6·h` to `43.5·h` bytes
    /// a token at bf16 for the shapes benched and Llama-2-7B's, where Korthikanti et al.
    /// 2022 count `34·h` for a GPT layer); with checkpointing, the layers'
    /// inputs (`p·h` a token each) and one layer's whole set; and the logits:
    /// the model's, the loss's fp32 upcast of 16-bit ones and log-softmax's
    /// fp32 output (`(p + 4 + 4)·V` a token at 16 bits, `8·V` at fp32).
    pub activations: f64,
}

impl TorchMemory {
    /// Everything.
    pub fn total(&self) -> f64 {
        self.states + self.root + self.in_flight + self.hpz + self.activations
    }
}

/// The memory model of `mode` (see [`TorchMemory`]'s fields for each part's formula).
pub fn memory(
    d: &Decoder,
    mode: TorchMode,
    nodes: usize,
    local: usize,
    sh: Sharding,
    batch: usize,
    checkpointing: bool,
) -> Result<TorchMemory> {
    let pr = sh.precision;
    super::torch_job::check_job(d, nodes, local, pr)?;
    let w = nodes * local;
    let shard = |ps: &[Param]| ps.iter().map(|q| q.shard(w)).sum::<usize>() as f64;
    let (layer, root) = (d.layer_params(), d.root_params());
    let all = d.layers as f64 * shard(&layer) + shard(&root);
    let numel = |ps: &[Param]| ps.iter().map(Param::numel).sum::<usize>() as f64;
    let (p, r) = (pr.param_bytes as f64, pr.reduce_bytes as f64);
    let hpz = match mode {
        // On one node `reshard_after_forward=L` is the world: FSDP2 reshards fully.
        TorchMode::Fsdp2 | TorchMode::Fsdp2Hpz if nodes == 1 => 0.0,
        TorchMode::Fsdp2 => 0.0,
        TorchMode::Fsdp2Hpz => d.layers as f64 * shard(&layer) * w as f64 / local as f64 * p,
        TorchMode::ZeroppTorch if nodes > 1 && local > 1 => {
            let int8 = QuantSpec::int8(256).ok();
            let e: f64 = layer
                .iter()
                .map(|q| match (q.one_d, int8) {
                    (false, Some(s)) => encoded_len(s, q.shard(w)) as f64,
                    _ => (q.shard(w) * pr.param_bytes) as f64,
                })
                .sum();
            d.layers as f64 * nodes as f64 * e
        }
        TorchMode::ZeroppTorch => 0.0,
    };
    let tokens = (d.seq * batch) as f64;
    let (h, l) = (d.hidden as f64, d.layers as f64);
    let per_layer = tokens * d.layer_activation_bytes(p);
    // The model's logits in their dtype (the output holds them), the loss's fp32
    // upcast of a 16-bit one, and log-softmax's fp32 output, saved for its backward.
    let upcast = if pr.param_bytes < 4 { 4.0 } else { 0.0 };
    let logits = tokens * d.vocab as f64 * (p + upcast + 4.0);
    let activations = logits + if checkpointing { l * tokens * h * p + per_layer } else { l * per_layer };
    Ok(TorchMemory {
        states: 16.0 * all,
        // Held from its forward to its backward's end, with its unsharded gradient
        // (the head's is the backward's first, its reduce-scatter the last).
        root: if sh.root_reshards { 0.0 } else { numel(&root) * (p + r) },
        in_flight: if sh.root_reshards {
            (numel(&layer) + numel(&layer).max(numel(&root))) * p + numel(&layer).max(numel(&root)) * r
        } else {
            2.0 * numel(&layer) * p + numel(&layer) * r
        },
        hpz,
        activations,
    })
}
