//! `zeropp plan`: the step time, bytes and memory per GPU of ZeRO-3, ZeRO++,
//! zeropp-delta and each ZeRO++ switch alone, for a GPT of any size on any
//! cluster, before running anything.
//!
//! Nothing here is a second formula for the traffic or the memory: a mode's
//! bytes are the engine's byte model ([`zeropp_engine::engine::bytes`], which
//! the traffic counters of every run equal to the byte) of the GPT the shape
//! describes, and its memory is the engine's memory model
//! ([`zeropp_engine::engine::memory::predict`]). The planner adds a time model
//! (docs/PERFORMANCE.md, "Planning"):
//!
//! - **Compute.** A micro-batch of `B` sequences of `s` tokens through `l`
//!   blocks of width `h` (MLP ratio `r`) and a vocabulary `V` costs, forward,
//!   `F_b = (8 + 4r)·B·s·l·h² + 4·B·s²·l·h` in the blocks and
//!   `F_v = 2·B·s·h·V` in the head (Megatron-LM's count); backward twice the
//!   forward; activation checkpointing recomputes the blocks' forward once
//!   more. The time is each GEMM's at the rate its shape gets on the GPU,
//!   tiles at `peak · compute_efficiency`, with tile and wave quantization on
//!   its SMs, the HBM roofline and a launch ([`Compute::Shapes`], the
//!   default, [`Gemm::seconds`]); or `FLOPs / (peak · compute_efficiency)`
//!   ([`Compute::Flat`]).
//! - **Links.** An operation's bytes per GPU (intra-node, inter-node) take
//!   `intra / (intra_bw · link_efficiency)` on the GPU's own intra-node link and
//!   `L · inter / (inter_bw · link_efficiency)` on its node's inter-node link
//!   (`inter_bw` is per node, shared by its `L` GPUs); the two link classes run
//!   at once (a routed collective's rail and node stages are serial within
//!   one call, but the prefetch keeps several layers' calls in flight), so an
//!   operation takes the longer, plus one latency per hop of each collective
//!   call (2 for a call routed over the rail then the node, for qgZ's two
//!   hops, for the norm's exchange and qwZ-Δ's; 1 for a flat call) and its
//!   quantization kernels' time: the elements they pass over the device's
//!   kernel rate ([`GpuSpec::kernel_elements_per_s`]; for a GPU preset its
//!   HBM bound, each element read at one width and written at the other, 3
//!   bytes at the 16-bit/8-bit widths).
//! - **Overlap ([`Overlap::Prefetch`], ZeRO's prefetch, the default).** The
//!   forward gathers run under the forward compute, the backward gathers and
//!   the gradient reduce-scatters under the backward compute (recompute
//!   included), pipelined over the `n` layers one ahead: of a side's total
//!   communication `T` under its compute `C`, `T/n + (n-1)/n·max(0, T - C)` is
//!   exposed. The norm exchange and the persistent parameters' gather are
//!   exposed whole. [`Overlap::None`] exposes everything (`T`), and
//!   [`Overlap::Exposed`] a measured fraction `f` of it (`f·T`).
//! - **Not counted:** the optimizer step, the data loader, kernel launch
//!   overheads beyond the per-call latency, congestion between the two link
//!   classes.
//!
//! Two constants are free: the compute efficiency (achieved / peak) and the
//! link efficiency (achieved / nominal). [`Efficiency::default`] says where
//! each comes from, the GEMM model's constants cite theirs ([`compute`]'s
//! docs); every other figure is a prediction.

pub mod compute;
mod decoder;
pub mod fsdp2;
mod fsdp2_memory;
mod hardware;
mod model;
mod time;
mod torch_job;

use std::collections::BTreeMap;

use zeropp_comm::Topology;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::engine::bytes::{StepKind, step_bytes_of};
use zeropp_engine::engine::{CommPlan, build_plan, memory};
use zeropp_engine::model::{Gpt, GptConfig};

use crate::{Result, RunError};
pub use compute::{Compute, Gemm, V100_GEMM_EFFICIENCY, Work};
pub use decoder::{Decoder, Param};
pub use fsdp2::{Backend, Precision, Sharding, TorchMode, TorchPlanInput, fsdp2_step_bytes, plan_fsdp2};
pub use fsdp2_memory::{TorchMemory, memory as fsdp2_memory};
pub use hardware::{Cluster, GpuSpec, parse_bandwidth};
pub use model::PlanModel;
pub use time::Overlap;
use time::{OpTime, StepTimes};

/// What a mode turns on: ZeRO-3 (hierarchical or flat routing), ZeRO++,
/// zeropp-delta, or one ZeRO++ switch alone over hierarchical ZeRO-3.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PlanMode {
    /// ZeRO-3 with bf16 communication, routed over the rail then the node.
    Zero3,
    /// ZeRO-3 with every collective flat over the world.
    Zero3Flat,
    /// ZeRO++: qwZ, hpZ over the node and qgZ ([`ZeroConfig::zeropp`]).
    Zeropp,
    /// ZeRO++ with qwZ-Δ and two-level Hadamard qgZ ([`ZeroConfig::zeropp_delta`]).
    ZeroppDelta,
    /// qwZ alone.
    Qwz,
    /// hpZ alone (over the node).
    Hpz,
    /// qgZ alone.
    Qgz,
}

impl PlanMode {
    /// Every mode, in the order of the tables.
    pub const ALL: [PlanMode; 7] = [
        PlanMode::Zero3,
        PlanMode::Zero3Flat,
        PlanMode::Zeropp,
        PlanMode::ZeroppDelta,
        PlanMode::Qwz,
        PlanMode::Hpz,
        PlanMode::Qgz,
    ];

    /// The name `--mode` and the JSON use.
    pub fn name(self) -> &'static str {
        match self {
            PlanMode::Zero3 => "zero3",
            PlanMode::Zero3Flat => "zero3-flat",
            PlanMode::Zeropp => "zeropp",
            PlanMode::ZeroppDelta => "zeropp-delta",
            PlanMode::Qwz => "qwz",
            PlanMode::Hpz => "hpz",
            PlanMode::Qgz => "qgz",
        }
    }

    /// The mode called `name`.
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL.into_iter().find(|m| m.name() == name.trim()).ok_or_else(|| {
            let known: Vec<&str> = Self::ALL.iter().map(|m| m.name()).collect();
            RunError::InvalidConfig(format!("--mode `{name}`: unknown (known: {})", known.join(", ")))
        })
    }

    /// The engine's configuration of this mode on nodes of `local` GPUs.
    pub fn zero(self, local: usize) -> ZeroConfig {
        let z3 = ZeroConfig::zero3();
        match self {
            PlanMode::Zero3 => z3,
            PlanMode::Zero3Flat => ZeroConfig { routing: zeropp_comm::collectives::Routing::Flat, ..z3 },
            PlanMode::Zeropp => ZeroConfig::zeropp(local),
            PlanMode::ZeroppDelta => ZeroConfig::zeropp_delta(local),
            PlanMode::Qwz => z3.with_qwz(ZeroConfig::default_qwz_spec()),
            PlanMode::Hpz => z3.with_hpz(local),
            PlanMode::Qgz => ZeroConfig { qgz: ZeroConfig::zeropp(local).qgz, ..z3 },
        }
    }
}

/// The two free constants of the time model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// Achieved / peak compute throughput: of each GEMM tile under
    /// [`Compute::Shapes`], of every FLOP under [`Compute::Flat`].
    pub compute: f64,
    /// Achieved / nominal bandwidth of every link.
    pub link: f64,
}

impl Default for Efficiency {
    /// `compute` 0.5: training reaches about half the tensor-core peak end to
    /// end (Megatron-LM reports 44-52% of peak on A100s for GPT models of
    /// 1.7B-1T parameters, Narayanan et al. 2021, Table 1), the
    /// normalisations, activations, optimizer and framework between the GEMMs
    /// included; a GEMM alone reaches more ([`V100_GEMM_EFFICIENCY`]).
    /// `link` 0.8: NCCL's bus bandwidth on InfiniBand and NVLink reaches about
    /// 80% of the nominal rate for large messages.
    fn default() -> Self {
        Self { compute: 0.5, link: 0.8 }
    }
}

/// What every plan shares, whatever runs the job: the work per GPU, the
/// cluster, the GPU and the time model's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Setting {
    /// Tokens per GPU per micro-batch (a multiple of the context, or at most one context).
    pub tokens: usize,
    /// The cluster.
    pub cluster: Cluster,
    /// The GPU.
    pub gpu: GpuSpec,
    /// The compute model.
    pub compute: Compute,
    /// The time model's two constants.
    pub efficiency: Efficiency,
    /// Activation checkpointing (recompute the blocks' forward in backward).
    pub checkpointing: bool,
    /// How communication overlaps compute.
    pub overlap: Overlap,
}

impl Setting {
    /// The context and the sequences per micro-batch of a model whose context
    /// is `context`: `tokens` as sequences of at most `context` tokens, an
    /// error unless it is at most one context or a whole number of them.
    fn micro_batch(&self, context: usize) -> Result<(usize, usize)> {
        if self.tokens == 0 {
            return Err(RunError::InvalidConfig("--tokens 0: expected a positive number of tokens".into()));
        }
        let seq = context.min(self.tokens);
        if self.tokens > seq && !self.tokens.is_multiple_of(seq) {
            return Err(RunError::InvalidConfig(format!(
                "--tokens {}: expected a positive multiple of the context ({seq}) or at most one context",
                self.tokens
            )));
        }
        Ok((seq, self.tokens.div_ceil(seq)))
    }
}

/// Everything a plan of the engine's job needs.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// The model.
    pub model: PlanModel,
    /// The work per GPU, the cluster, the GPU and the time model's settings.
    pub setting: Setting,
    /// The modes to plan, in order.
    pub modes: Vec<PlanMode>,
}

/// One mode's plan, per GPU per optimizer step (one micro-batch of
/// [`Setting::tokens`]). For zeropp-delta the figures are the mean over its
/// refresh period: one full step per `refresh_every` steps, differences between.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModePlan {
    /// Step time, seconds.
    pub step_s: f64,
    /// Compute time, seconds.
    pub compute_s: f64,
    /// Exposed (not hidden) communication time per operation tag, seconds.
    pub exposed_s: BTreeMap<String, f64>,
    /// FLOP/s per GPU in TFLOP/s: the FLOPs of [`PlanModel::flops`] (Megatron-LM's
    /// count, the recomputed forward included under checkpointing, as
    /// DeepSpeed reports its throughput) over the step.
    pub tflops_per_gpu: f64,
    /// Bytes per GPU per step sent to GPUs of the same node.
    pub intra_node_bytes: f64,
    /// Bytes per GPU per step sent to GPUs of other nodes.
    pub inter_node_bytes: f64,
    /// Bytes per step through a node's inter-node link as the time model
    /// has them: its GPUs' inter-node bytes, except that a flat ring
    /// collective of FSDP2's puts one piece per rank through it (see
    /// [`plan_fsdp2`]).
    pub nic_bytes_per_node: f64,
    /// The engine's memory model: bytes per GPU, everything (its activations
    /// are the engine's: an f32 tape without checkpointing, attention
    /// probabilities included).
    pub memory_bytes: f64,
    /// Of that, all but the activations: the sharded states (fp32 master,
    /// AdamW moments, the gradient shard), hpZ's secondary shards, LoCo's
    /// residuals, qwZ-Δ's reconstruction and the gathered layers in flight.
    pub state_bytes: f64,
    /// Speedup over the first mode of the plan (its step / this step).
    pub speedup: f64,
    /// Elements through the quantization kernels per GPU per step (quantize
    /// and dequantize passes, the fused qgZ reduce counted as a second pass).
    pub quantized_elements: f64,
}

/// A plan: the modes' figures, keyed by mode name, with the inputs that made them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
    /// What runs the job: `engine` (zeropp's engine, [`plan`]) or `fsdp2`
    /// (PyTorch's FSDP2, with or without zeropp.torch, [`plan_fsdp2`]).
    pub framework: String,
    /// Parameters of the model planned.
    pub params: usize,
    /// Its shape: blocks, width, vocabulary, context.
    pub layers: usize,
    /// Width.
    pub hidden: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// Context (tokens per sequence).
    pub seq: usize,
    /// Tokens per GPU per micro-batch.
    pub tokens: usize,
    /// FLOPs per GPU per step ([`PlanModel::flops`], the recomputed forward
    /// included under checkpointing).
    pub flops_per_gpu: f64,
    /// GPUs.
    pub gpus: usize,
    /// The intra-node rate per GPU used, bytes/s each way.
    pub intra_bytes_per_s: f64,
    /// The GPU preset.
    pub gpu: String,
    /// The compute efficiency used.
    pub compute_efficiency: f64,
    /// The compute model, in words.
    pub compute_model: String,
    /// The link efficiency used.
    pub link_efficiency: f64,
    /// The overlap model used.
    pub overlap: Overlap,
    /// Per mode, by name.
    pub modes: BTreeMap<String, ModePlan>,
    /// The mode names in the order asked.
    pub order: Vec<String>,
}

/// Plans every mode of `input` (see the [module docs](self)).
///
/// ```
/// use zeropp_run::plan::{Cluster, Compute, Efficiency, GpuSpec, Overlap, PlanInput, PlanMode, PlanModel, Setting, plan};
/// let input = PlanInput {
///     model: PlanModel::from_params(1e9, PlanModel::DEFAULT_VOCAB, 2048)?,
///     setting: Setting {
///         tokens: 2048,
///         cluster: Cluster { nodes: 4, gpus_per_node: 8, inter_bytes_per_s: 12.5e9, intra_bytes_per_s: 300e9, latency_s: 20e-6 },
///         gpu: GpuSpec::preset("a100").ok_or("preset")?,
///         compute: Compute::Shapes,
///         efficiency: Efficiency::default(),
///         checkpointing: true,
///         overlap: Overlap::Prefetch,
///     },
///     modes: vec![PlanMode::Zero3, PlanMode::Zeropp],
/// };
/// let p = plan(&input)?;
/// let (z3, zpp) = (&p.modes["zero3"], &p.modes["zeropp"]);
/// assert!(zpp.inter_node_bytes < 0.3 * z3.inter_node_bytes);
/// assert!(zpp.step_s <= z3.step_s);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn plan(input: &PlanInput) -> Result<Plan> {
    let st = &input.setting;
    check_rates(&time::Rates::from(st))?;
    let c = &st.cluster;
    if input.modes.is_empty() {
        return Err(RunError::InvalidConfig("--mode: no mode to plan".into()));
    }
    let mut model = input.model;
    let (seq, batch) = st.micro_batch(model.gpt.seq_len)?;
    model.gpt.seq_len = seq;
    // The engine's GPT sizes its position table at most MAX_SEQ_LEN rows (its
    // training limit); a longer context's extra rows, `(seq - 1024)·h`
    // parameters (0.06% of a 7B model at 2048), are left out of the bytes and
    // the states. The activations are the engine's formula at the real context.
    let engine_seq = seq.min(GptConfig::MAX_SEQ_LEN);
    let gpt = Gpt::new(GptConfig { seq_len: engine_seq, ..model.gpt })?;
    let topo = Topology::ranks(c.world())
        .per_node(c.gpus_per_node)
        .map_err(|e| RunError::InvalidConfig(format!("cluster {} x {}: {e}", c.nodes, c.gpus_per_node)))?;
    let work = model.work(batch);
    let flops = work.flops(st.checkpointing);
    let compute = work.seconds(&st.gpu, st.compute, st.efficiency.compute, st.checkpointing);
    let rates = time::Rates::from(st);
    let mut modes = BTreeMap::new();
    let mut order = Vec::new();
    let mut first_step = None;
    for &mode in &input.modes {
        let cfg = EngineConfig {
            zero: mode.zero(c.gpus_per_node),
            global_batch: c.world() * batch,
            grad_accum: 1,
            ..EngineConfig::default()
        };
        let pp = build_plan(&gpt, &cfg, topo)?;
        let cp = CommPlan::new(&pp, &cfg)?;
        let mut kinds = vec![(StepKind::Full, 1.0)];
        if let Some(d) = cfg.zero.qwz_delta.filter(|d| d.refresh_every > 1 && cfg.zero.hpz_size > 1) {
            let r = d.refresh_every as f64;
            kinds = vec![(StepKind::Full, 1.0 / r), (StepKind::Delta, (r - 1.0) / r)];
        }
        let mut acc = StepTimes::default();
        let (mut intra, mut inter, mut quantized) = (0.0, 0.0, 0.0);
        for (kind, weight) in kinds {
            let bytes = step_bytes_of(&pp, &cfg, 1, kind)?;
            let calls = time::calls_per_step(&cp, kind);
            quantized += weight * calls.quantized_elements();
            let ops: Vec<OpTime> =
                bytes.by_op.iter().map(|(tag, b)| OpTime::of(tag, *b, &calls, &rates)).collect();
            // The embedding, the blocks and the head: one gather each.
            let t = StepTimes::of(&ops, compute, &rates, model.gpt.n_layer + 2);
            acc.add(&t, weight);
            let total = bytes.total();
            intra += weight * total.intra;
            inter += weight * total.inter;
        }
        let mut mem = memory::predict(&gpt, &pp, &cfg, batch)?;
        mem.activations = zeropp_engine::Model::activation_bytes(&gpt, batch, seq);
        let step = acc.step();
        let first = *first_step.get_or_insert(step);
        modes.insert(
            mode.name().to_string(),
            ModePlan {
                step_s: step,
                compute_s: acc.compute,
                exposed_s: acc.exposed.clone(),
                tflops_per_gpu: (flops.0 + flops.1) / step / 1e12,
                intra_node_bytes: intra,
                inter_node_bytes: inter,
                nic_bytes_per_node: inter * c.gpus_per_node as f64,
                memory_bytes: mem.total() as f64,
                state_bytes: (mem.total() - mem.activations) as f64,
                speedup: first / step,
                quantized_elements: quantized,
            },
        );
        order.push(mode.name().to_string());
    }
    Ok(Plan {
        framework: "engine".into(),
        params: model.params(),
        layers: model.gpt.n_layer,
        hidden: model.gpt.d_model,
        vocab: model.gpt.vocab,
        seq,
        tokens: st.tokens,
        flops_per_gpu: flops.0 + flops.1,
        gpus: c.world(),
        intra_bytes_per_s: c.intra_bytes_per_s,
        gpu: st.gpu.name.clone(),
        compute_efficiency: st.efficiency.compute,
        compute_model: compute::describe(&st.gpu, st.compute, st.efficiency.compute),
        link_efficiency: st.efficiency.link,
        overlap: st.overlap,
        modes,
        order,
    })
}

/// The cluster, GPU, efficiencies and overlap of a plan are in range.
fn check_rates(r: &time::Rates<'_>) -> Result<()> {
    let c = r.cluster;
    if c.nodes == 0 || c.gpus_per_node == 0 {
        return Err(RunError::InvalidConfig("--nodes and --gpus-per-node must be positive".into()));
    }
    if c.nodes.saturating_mul(c.gpus_per_node) > 1 << 20 {
        return Err(RunError::InvalidConfig(format!(
            "--nodes {} x --gpus-per-node {}: at most 2^20 GPUs",
            c.nodes, c.gpus_per_node
        )));
    }
    for (what, v) in
        [("--compute-efficiency", r.efficiency.compute), ("--link-efficiency", r.efficiency.link)]
    {
        if !(v > 0.0 && v <= 1.0) {
            return Err(RunError::InvalidConfig(format!("{what} {v}: expected a fraction in (0, 1]")));
        }
    }
    for (what, v) in [
        ("inter-node bandwidth", c.inter_bytes_per_s),
        ("intra-node bandwidth", c.intra_bytes_per_s),
        ("GPU peak", r.gpu.peak_flops),
        ("GPU memory bandwidth", r.gpu.hbm_bytes_per_s),
        ("GPU quantization kernel rate", r.gpu.kernel_elements_per_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(RunError::InvalidConfig(format!("{what} must be positive, not {v}")));
        }
    }
    if !(c.latency_s.is_finite() && c.latency_s >= 0.0) {
        return Err(RunError::InvalidConfig(format!("latency must be at least 0, not {}", c.latency_s)));
    }
    if let Overlap::Exposed(f) = r.overlap
        && !(0.0..=1.0).contains(&f)
    {
        return Err(RunError::InvalidConfig(format!("--overlap {f}: an exposed fraction is from 0 to 1")));
    }
    Ok(())
}
