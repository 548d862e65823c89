//! `zeropp plan --framework fsdp2`: a PyTorch job, a Hugging Face
//! Llama-family [`Decoder`] under FSDP2 (`fully_shard` on every decoder layer
//! and on the root), with FSDP2's own collectives or with zeropp.torch's.
//!
//! **Bytes** ([`fsdp2_step_bytes`]) are what `zeropp.torch.ByteCounter` counts for
//! one forward and backward on every rank (a test runs both and compares them
//! to the byte): per collective call, an all-gather sends its input to each
//! other member of its group, a reduce-scatter and an all-to-all `1/G` of it to
//! each; bytes to members on other nodes are inter-node. Per FSDP2 module of
//! parameters `p` (each a shard of dim 0 padded to a multiple of the world `W`,
//! `S` elements a rank in all):
//!
//! - [`TorchMode::Fsdp2`] (`reshard_after_forward=True`): a forward all-gather
//!   of `S` in the parameters' dtype over the world, the same again in the
//!   backward, and a reduce-scatter of `S` in the reduce dtype. The root, left
//!   at FSDP2's default (`fully_shard(model)`, `reshard_after_forward=None`),
//!   is not resharded after its forward, so it gathers once; given
//!   `reshard_after_forward` as the layers are ([`Sharding::root_reshards`]),
//!   it reshards and gathers again as they do.
//! - [`TorchMode::Fsdp2Hpz`] (`reshard_after_forward=L`, the GPUs per node):
//!   the backward gather runs inside the node, of `W·S/L` a rank (the
//!   forward's output cut in `L`).
//! - [`TorchMode::ZeroppTorch`] (`zeropp.torch.enable` with its defaults): the
//!   forward gather sends each parameter's shard INT8 in groups of 256 (its
//!   wire encoding, `zeropp_quant::encoded_len`), the 1-D ones in the
//!   parameters' dtype; zeropp's hpZ keeps the node's share and the backward
//!   gather inside the node sends `N` such encodings (`N` nodes); qgZ's
//!   reduce-scatter is two all-to-alls, INT4 in groups of 256 within the node
//!   then over the rail (`zeropp_comm`'s `QgzStages` chunk sizes, every
//!   parameter from a group boundary), the 1-D parameters' columns riding
//!   along as float32. On one node every call is torch's own.
//!
//! **Time** is the engine planner's model (the [parent module's docs](super))
//! over what the links carry: a flat all-gather or reduce-scatter runs as a
//! ring: each rank passes its `G - 1` pieces to its successor, so the
//! busiest NVLink carries `(G-1)·b` and a node's NIC `(G-1)·b`, about one copy
//! of what the world gathers, where its ranks hand over `L·(G-L)·b`; gloo's
//! reduce-scatter is a ring all-reduce, twice that ([`Backend::Gloo`]). An
//! all-to-all (qgZ's two hops) sends what it is handed.
//!
//! Not counted: the optimizer (local under FSDP2), a gradient-norm clip (one
//! all-reduce of a scalar) and the loss's logging.

use std::collections::BTreeMap;

use zeropp_comm::Topology;
use zeropp_comm::collectives::{QgzOptions, QgzStages};
use zeropp_engine::engine::tags;
use zeropp_engine::metrics::LinkBytes;
use zeropp_quant::{QuantSpec, encoded_len};

use super::decoder::{Decoder, Param};
use super::time::{Calls, OpTime, Rates, StepTimes};
pub use super::torch_job::{Backend, Precision, Sharding, TorchMode};
use super::{ModePlan, Plan, Setting};
use crate::{Result, RunError};

/// Everything a PyTorch job's plan needs.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchPlanInput {
    /// The model.
    pub decoder: Decoder,
    /// The work per GPU, the cluster, the GPU and the time model's settings.
    pub setting: Setting,
    /// The dtypes on the wire and the root's resharding.
    pub sharding: Sharding,
    /// The modes to plan, in order.
    pub modes: Vec<TorchMode>,
}

/// One FSDP2 module: its parameters, and whether FSDP2 reshards it after
/// the forward (every decoder layer; not the root).
struct Unit {
    params: Vec<Param>,
    reshards: bool,
}

fn units(d: &Decoder, sharding: Sharding) -> Vec<Unit> {
    let mut u: Vec<Unit> = (0..d.layers).map(|_| Unit { params: d.layer_params(), reshards: true }).collect();
    u.push(Unit { params: d.root_params(), reshards: sharding.root_reshards });
    u
}

/// The groups a call runs on, as (members on this node, members on other nodes) besides the caller.
#[derive(Clone, Copy)]
struct Group {
    intra: f64,
    inter: f64,
}

fn sends(to: Group, bytes_each: f64) -> LinkBytes {
    LinkBytes { intra: to.intra * bytes_each, inter: to.inter * bytes_each }
}

/// A call handing `bytes_each` to each other member of `to`: (what ByteCounter
/// counts, what the links carry per GPU for the time model). An all-gather or
/// reduce-scatter runs as a ring (NCCL's algorithm for large messages): each
/// rank passes its `G - 1` pieces to its successor, so the busiest NVLink
/// carries `(G-1)·b` and a node's NIC `(G-1)·b` (`(G-1)·b / L` a GPU), where
/// the ranks hand over `L·(G-L)·b`; an all-to-all sends what it is handed.
/// `rounds` is 2 for a ring all-reduce (gloo's reduce-scatter), else 1.
fn call(to: Group, ring: bool, bytes_each: f64, local: usize, rounds: f64) -> (LinkBytes, LinkBytes) {
    let counted = sends(to, bytes_each);
    if !ring {
        return (counted, counted);
    }
    let pieces = rounds * (to.intra + to.inter);
    let wire = LinkBytes {
        intra: if to.intra > 0.0 { pieces * bytes_each } else { 0.0 },
        inter: if to.inter > 0.0 { pieces * bytes_each / local as f64 } else { 0.0 },
    };
    (counted, wire)
}

/// One step of a mode: bytes per operation tag, and its calls for the time model.
pub(super) struct TorchStep {
    /// Bytes per GPU per operation tag ([`tags`]), as ByteCounter counts them.
    pub(super) by_op: BTreeMap<&'static str, LinkBytes>,
    /// What the links carry per GPU per operation tag (see [`call`]).
    pub(super) wire: BTreeMap<&'static str, LinkBytes>,
    pub(super) calls: Calls,
}

/// The bytes every rank hands torch.distributed in one forward and backward
/// of `d` under `mode` on `nodes × local` ranks, per operation tag (see the
/// [module docs](self)).
///
/// ```
/// use zeropp_run::plan::{Backend, Decoder, Precision, Sharding, TorchMode, fsdp2_step_bytes};
/// let d = Decoder::from_spec("llama:d=768,layers=8,heads=12,kv_heads=4,ff=2048", 128)?.ok_or("llama")?;
/// let bf16 = Sharding { precision: Precision { param_bytes: 2, reduce_bytes: 2 }, root_reshards: false, backend: Backend::Nccl };
/// let base = fsdp2_step_bytes(&d, TorchMode::Fsdp2, 2, 2, bf16)?;
/// let zpp = fsdp2_step_bytes(&d, TorchMode::ZeroppTorch, 2, 2, bf16)?;
/// let inter = |b: &std::collections::BTreeMap<&str, zeropp_engine::metrics::LinkBytes>| {
///     b.values().map(|x| x.inter).sum::<f64>()
/// };
/// assert!(inter(&zpp) < 0.3 * inter(&base));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn fsdp2_step_bytes(
    d: &Decoder,
    mode: TorchMode,
    nodes: usize,
    local: usize,
    sharding: Sharding,
) -> Result<BTreeMap<&'static str, LinkBytes>> {
    Ok(step(d, mode, nodes, local, sharding)?.by_op)
}

pub(super) fn step(
    d: &Decoder,
    mode: TorchMode,
    nodes: usize,
    local: usize,
    sh: Sharding,
) -> Result<TorchStep> {
    super::torch_job::check_job(d, nodes, local, sh.precision)?;
    let pr = sh.precision;
    let topo = Topology::ranks(nodes * local)
        .per_node(local)
        .map_err(|e| RunError::InvalidConfig(format!("cluster {nodes} x {local}: {e}")))?;
    let w = nodes * local;
    let world = Group { intra: (local - 1) as f64, inter: (w - local) as f64 };
    let node = Group { intra: (local - 1) as f64, inter: 0.0 };
    let rail = Group { intra: 0.0, inter: (nodes - 1) as f64 };
    let crosses = nodes > 1;
    let (p, r) = (pr.param_bytes as f64, pr.reduce_bytes as f64);
    let int8 = QuantSpec::int8(256).map_err(|e| RunError::InvalidConfig(e.to_string()))?;
    let int4 = QuantSpec::int4(256).map_err(|e| RunError::InvalidConfig(e.to_string()))?;
    let mut by_op: BTreeMap<&'static str, LinkBytes> = BTreeMap::new();
    let mut wire: BTreeMap<&'static str, LinkBytes> = BTreeMap::new();
    let mut calls: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut quantized: BTreeMap<&'static str, f64> = BTreeMap::new();
    let mut add = |tag: &'static str, (b, w): (LinkBytes, LinkBytes), q: f64| {
        for (map, x) in [(&mut by_op, b), (&mut wire, w)] {
            let e = map.entry(tag).or_default();
            e.intra += x.intra;
            e.inter += x.inter;
        }
        *calls.entry(tag).or_default() += 1.0;
        *quantized.entry(tag).or_default() += q;
    };
    let zeropp = mode == TorchMode::ZeroppTorch;
    let rs_rounds = if sh.backend == Backend::Gloo { 2.0 } else { 1.0 };
    for u in units(d, sh) {
        let s: usize = u.params.iter().map(|q| q.shard(w)).sum();
        let full = (w * s) as f64;
        // qwZ's wire bytes a rank: each parameter's shard encoded on its own.
        let e: usize = u
            .params
            .iter()
            .map(|q| if q.one_d { q.shard(w) * pr.param_bytes } else { encoded_len(int8, q.shard(w)) })
            .sum();
        let (e, s) = (e as f64, s as f64);
        let qwz = zeropp && crosses;
        add(
            tags::FWD_GATHER,
            call(world, true, if qwz { e } else { s * p }, local, 1.0),
            if qwz { full } else { 0.0 },
        );
        if u.reshards {
            let (b, q) = match mode {
                TorchMode::Fsdp2 => (call(world, true, s * p, local, 1.0), 0.0),
                TorchMode::Fsdp2Hpz => (call(node, true, w as f64 * s / local as f64 * p, local, 1.0), 0.0),
                // zeropp's hpZ: the node's encodings, all nodes' shards of this local rank.
                TorchMode::ZeroppTorch if qwz && local > 1 => {
                    (call(node, true, nodes as f64 * e, local, 1.0), full)
                }
                TorchMode::ZeroppTorch if qwz => (call(world, true, e, local, 1.0), full),
                TorchMode::ZeroppTorch => (call(world, true, s * p, local, 1.0), 0.0),
            };
            add(tags::BWD_GATHER, b, q);
        }
        // qgZ's vector: every quantized parameter from a group boundary; the 1-D ones exact.
        let cq: usize = u.params.iter().filter(|q| !q.one_d).map(|q| q.shard(w).div_ceil(256) * 256).sum();
        let k1: usize = u.params.iter().filter(|q| q.one_d).map(|q| q.shard(w)).sum();
        if zeropp && crosses && cq > 0 {
            let opts = QgzOptions::default().with_spec(int4);
            let st = QgzStages::new(&topo, 0, w * cq, &opts)
                .map_err(|e| RunError::InvalidConfig(e.to_string()))?;
            let mut b = LinkBytes::default();
            if st.intra_chunk_len() > 0 {
                let x = sends(node, (st.intra_chunk_len() + nodes * k1 * 4) as f64);
                b.intra += x.intra;
            }
            if st.inter_chunk_len() > 0 {
                let x = sends(rail, (st.inter_chunk_len() + k1 * 4) as f64);
                b.inter += x.inter;
            }
            add(tags::GRAD_REDUCE, (b, b), 2.0 * full);
        } else {
            add(tags::GRAD_REDUCE, call(world, true, s * r, local, rs_rounds), 0.0);
        }
    }
    let hops_of = if zeropp && nodes > 1 && local > 1 {
        BTreeMap::from([(tags::GRAD_REDUCE, 2.0)])
    } else {
        BTreeMap::new()
    };
    Ok(TorchStep { by_op, wire, calls: Calls::flat(calls, quantized, hops_of) })
}

/// Plans every mode of `input`: the time model of the [parent module's
/// docs](super) over [`fsdp2_step_bytes`], and [`memory`](super::fsdp2_memory())'s bytes per GPU.
///
/// ```
/// use zeropp_run::plan::{Backend, Cluster, Compute, Decoder, Efficiency, GpuSpec, Overlap, Precision, Setting, Sharding, TorchMode, TorchPlanInput, plan_fsdp2};
/// let decoder = Decoder::from_spec("llama:d=4096,layers=32,heads=32,kv_heads=32,ff=11008", 4096)?.ok_or("llama")?;
/// let input = TorchPlanInput {
///     decoder,
///     setting: Setting {
///         tokens: 4096,
///         cluster: Cluster { nodes: 16, gpus_per_node: 8, inter_bytes_per_s: 12.5e9, intra_bytes_per_s: 450e9, latency_s: 20e-6 },
///         gpu: GpuSpec::preset("h100").ok_or("preset")?,
///         compute: Compute::Shapes,
///         efficiency: Efficiency::default(),
///         checkpointing: true,
///         overlap: Overlap::Prefetch,
///     },
///     sharding: Sharding { precision: Precision { param_bytes: 2, reduce_bytes: 4 }, root_reshards: false, backend: Backend::Nccl },
///     modes: TorchMode::ALL.to_vec(),
/// };
/// let p = plan_fsdp2(&input)?;
/// assert!(p.modes["zeropp-torch"].inter_node_bytes < 0.3 * p.modes["fsdp2"].inter_node_bytes);
/// assert!(p.modes["zeropp-torch"].memory_bytes < 80e9); // a 7B model fits an H100
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn plan_fsdp2(input: &TorchPlanInput) -> Result<Plan> {
    let set = &input.setting;
    let rates = Rates::from(set);
    super::check_rates(&rates)?;
    if input.modes.is_empty() {
        return Err(RunError::InvalidConfig("--mode: no mode to plan".into()));
    }
    let c = &set.cluster;
    super::torch_job::check_job(&input.decoder, c.nodes, c.gpus_per_node, input.sharding.precision)?;
    let mut d = input.decoder;
    let (seq, batch) = set.micro_batch(d.seq)?;
    d.seq = seq;
    let work = d.work(batch);
    let flops = work.flops(set.checkpointing);
    let compute = work.seconds(&set.gpu, set.compute, set.efficiency.compute, set.checkpointing);
    let mut modes = BTreeMap::new();
    let mut order = Vec::new();
    let mut first = None;
    for &mode in &input.modes {
        let st = step(&d, mode, c.nodes, c.gpus_per_node, input.sharding)?;
        let ops: Vec<OpTime> =
            st.wire.iter().map(|(tag, b)| OpTime::of(tag, *b, &st.calls, &rates)).collect();
        // The layers and the root: one gather each.
        let t = StepTimes::of(&ops, compute, &rates, d.layers + 1);
        let step_s = t.step();
        let first = *first.get_or_insert(step_s);
        let mem = super::fsdp2_memory::memory(
            &d,
            mode,
            c.nodes,
            c.gpus_per_node,
            input.sharding,
            batch,
            set.checkpointing,
        )?;
        modes.insert(
            mode.name().to_string(),
            ModePlan {
                step_s,
                compute_s: t.compute,
                exposed_s: t.exposed.clone(),
                tflops_per_gpu: (flops.0 + flops.1) / step_s / 1e12,
                intra_node_bytes: st.by_op.values().map(|b| b.intra).sum(),
                inter_node_bytes: st.by_op.values().map(|b| b.inter).sum(),
                nic_bytes_per_node: st.wire.values().map(|b| b.inter).sum::<f64>() * c.gpus_per_node as f64,
                memory_bytes: mem.total(),
                state_bytes: mem.total() - mem.activations,
                speedup: first / step_s,
                quantized_elements: st.calls.quantized_elements(),
            },
        );
        order.push(mode.name().to_string());
    }
    Ok(Plan {
        framework: "fsdp2".into(),
        params: d.params(),
        layers: d.layers,
        hidden: d.hidden,
        vocab: d.vocab,
        seq,
        tokens: set.tokens,
        flops_per_gpu: flops.0 + flops.1,
        gpus: c.world(),
        intra_bytes_per_s: c.intra_bytes_per_s,
        gpu: set.gpu.name.clone(),
        compute_efficiency: set.efficiency.compute,
        compute_model: super::compute::describe(&set.gpu, set.compute, set.efficiency.compute),
        link_efficiency: set.efficiency.link,
        overlap: set.overlap,
        modes,
        order,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama() -> Result<Decoder> {
        Decoder::from_spec("llama:d=256,layers=2,heads=4,kv_heads=2,vocab=1001", 64)?
            .ok_or_else(|| RunError::InvalidConfig("a llama".into()))
    }

    const BF16: Sharding = Sharding {
        precision: Precision { param_bytes: 2, reduce_bytes: 2 },
        root_reshards: false,
        backend: Backend::Nccl,
    };

    #[test]
    fn a_ring_puts_one_copy_of_a_gather_through_each_nic() -> Result<()> {
        let d = llama()?;
        let (nodes, local) = (4, 8);
        let w = nodes * local;
        let st = step(&d, TorchMode::Fsdp2, nodes, local, BF16)?;
        let shard: usize = d.layer_params().iter().map(|p| p.shard(w)).sum();
        let per_layer = 2.0 * shard as f64;
        let fwd = (st.by_op[tags::FWD_GATHER], st.wire[tags::FWD_GATHER]);
        let root: usize = d.root_params().iter().map(|p| p.shard(w)).sum();
        let calls = (d.layers as f64 * per_layer, 2.0 * root as f64);
        // Handed over: each other member gets the shard; on the NIC, (W-1) shards a node.
        assert_eq!(fwd.0.inter, (w - local) as f64 * (calls.0 + calls.1));
        assert_eq!(fwd.1.inter * local as f64, (w - 1) as f64 * (calls.0 + calls.1));
        // The all-to-alls (zeropp's qgZ) send what they are handed.
        let z = step(&d, TorchMode::ZeroppTorch, nodes, local, BF16)?;
        assert_eq!(z.by_op[tags::GRAD_REDUCE], z.wire[tags::GRAD_REDUCE]);
        // gloo's reduce-scatter is a ring all-reduce: twice NCCL's pieces, the same bytes handed over.
        let g = step(&d, TorchMode::Fsdp2, nodes, local, Sharding { backend: Backend::Gloo, ..BF16 })?;
        assert_eq!(g.by_op, st.by_op);
        let rs = |s: &TorchStep| s.wire[tags::GRAD_REDUCE].inter;
        assert_eq!(rs(&g), 2.0 * rs(&st));
        assert_eq!(g.wire[tags::FWD_GATHER], st.wire[tags::FWD_GATHER]);
        Ok(())
    }

    #[test]
    fn on_one_node_zeropp_torch_sends_what_fsdp2_sends() -> Result<()> {
        let d = llama()?;
        let (a, b) = (step(&d, TorchMode::Fsdp2, 1, 4, BF16)?, step(&d, TorchMode::ZeroppTorch, 1, 4, BF16)?);
        assert_eq!(a.by_op, b.by_op);
        assert!(a.by_op.values().all(|x| x.inter == 0.0 && x.intra > 0.0));
        // Across nodes it sends less than a third of FSDP2's inter-node bytes.
        let inter = |s: &TorchStep| s.by_op.values().map(|x| x.inter).sum::<f64>();
        let (a, b) = (step(&d, TorchMode::Fsdp2, 2, 4, BF16)?, step(&d, TorchMode::ZeroppTorch, 2, 4, BF16)?);
        assert!(inter(&b) < 0.3 * inter(&a), "{} vs {}", inter(&b), inter(&a));
        Ok(())
    }
}
