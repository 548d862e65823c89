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
//!   more. The time is `FLOPs / (peak · compute_efficiency)`.
//! - **Links.** An operation's bytes per GPU (intra-node, inter-node) take
//!   `intra / (intra_bw · link_efficiency)` on the GPU's own intra-node link and
//!   `L · inter / (inter_bw · link_efficiency)` on its node's inter-node link
//!   (`inter_bw` is per node, shared by its `L` GPUs); the two links run at
//!   once, so an operation takes the longer, plus one latency per collective
//!   call and its quantization kernels' time (each quantized element passes
//!   HBM once read and once written, 3 bytes at the 16-bit/8-bit widths).
//! - **Overlap ([`Overlap::Prefetch`], ZeRO's prefetch, the default).** The
//!   forward gathers run under the forward compute, the backward gathers and
//!   the gradient reduce-scatters under the backward compute (recompute
//!   included), pipelined over the `n` layers one ahead: of a side's total
//!   communication `T` under its compute `C`, `T/n + (n-1)/n·max(0, T - C)` is
//!   exposed. The norm exchange and the persistent parameters' gather are
//!   exposed whole. [`Overlap::None`] exposes everything (`T`).
//! - **Not counted:** the optimizer step, the data loader, kernel launch
//!   overheads beyond the per-call latency, congestion between the two link
//!   classes.
//!
//! Two constants are free: the compute efficiency (achieved / peak) and the
//! link efficiency (achieved / nominal). [`Efficiency::default`] says where
//! each comes from; every other figure is a prediction.

mod hardware;
mod time;

use std::collections::BTreeMap;

use zeropp_comm::Topology;
use zeropp_engine::config::{EngineConfig, ZeroConfig};
use zeropp_engine::engine::bytes::{StepKind, step_bytes_of};
use zeropp_engine::engine::{CommPlan, build_plan, memory};
use zeropp_engine::model::{Gpt, GptConfig};

use crate::{Result, RunError};
pub use hardware::{Cluster, GpuSpec, parse_bandwidth};
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

/// How communication overlaps compute in the time model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Overlap {
    /// ZeRO's prefetch: each layer's gathers (and, backward, its
    /// reduce-scatter) run under the neighbouring layer's compute; only what
    /// is longer than that compute, and the first layer's, is exposed.
    #[default]
    Prefetch,
    /// None: every collective's time adds to the compute (an upper bound on
    /// the step, e.g. where the collectives' kernels and the GEMMs contend).
    None,
}

impl Overlap {
    /// `--overlap`'s value: `prefetch` or `none`.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "prefetch" => Ok(Self::Prefetch),
            "none" => Ok(Self::None),
            _ => Err(RunError::InvalidConfig(format!("--overlap `{s}`: expected prefetch or none"))),
        }
    }
}

/// The two free constants of the time model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Efficiency {
    /// Achieved / peak compute throughput of the GPU on the model's GEMMs.
    pub compute: f64,
    /// Achieved / nominal bandwidth of every link.
    pub link: f64,
}

impl Default for Efficiency {
    /// `compute` 0.5: large fp16 GEMMs reach about half the tensor-core peak
    /// in end-to-end training (Megatron-LM reports 44-52% of peak on A100s for
    /// GPT models of 1.7B-1T parameters, Narayanan et al. 2021, Table 1).
    /// `link` 0.8: NCCL's bus bandwidth on InfiniBand and NVLink reaches about
    /// 80% of the nominal rate for large messages.
    fn default() -> Self {
        Self { compute: 0.5, link: 0.8 }
    }
}

/// The model the planner plans for: a GPT ([`GptConfig`]) of the shape given,
/// or derived from a parameter count ([`PlanModel::from_params`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanModel {
    /// The shape.
    pub gpt: GptConfig,
}

impl PlanModel {
    /// GPT-2's vocabulary, the default.
    pub const DEFAULT_VOCAB: usize = 50257;
    /// Width per attention head.
    pub const HEAD_DIM: usize = 128;

    /// The GPT of about `params` parameters with the default shape, GPT-3's
    /// aspect ratio of about 128 (13B is 40 × 5120, 175B 96 × 12288):
    /// `l = round((params / 196608)^(1/3))` blocks (`12·l·(128·l)² = params`),
    /// then the width, a multiple of 64, whose whole model (blocks, the
    /// untied embedding and head of GPT-2's vocabulary, context `seq`) comes
    /// nearest to `params`; heads of 128 (of 64 where the width is not a
    /// multiple of 128), MLP ratio 4.
    ///
    /// ```
    /// use zeropp_run::plan::PlanModel;
    /// let m = PlanModel::from_params(18e9, 2048)?;
    /// assert_eq!((m.gpt.n_layer, m.gpt.d_model), (45, 5696));
    /// assert!((m.params() as f64 / 18e9 - 1.0).abs() < 0.01);
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn from_params(params: f64, seq: usize) -> Result<Self> {
        if !(params.is_finite() && (1e6..=1e14).contains(&params)) {
            return Err(RunError::InvalidConfig(format!("--params {params}: expected 1e6 to 1e14")));
        }
        let l = (params / 196_608.0).cbrt().round().max(1.0) as usize;
        let count = |h: usize| Self::shaped(l, h, Self::DEFAULT_VOCAB, seq).map(|m| m.params() as f64);
        // params grows with h: scan the multiples of 64 up to where it passes `params`.
        let mut best = (f64::INFINITY, 64);
        let mut h = 64;
        loop {
            let off = count(h)? - params;
            if off.abs() < best.0 {
                best = (off.abs(), h);
            }
            if off > 0.0 {
                break;
            }
            h += 64;
        }
        Self::shaped(l, best.1, Self::DEFAULT_VOCAB, seq)
    }

    /// A GPT of `layers` blocks of width `hidden` (heads of 128, else of 64,
    /// else one head), vocabulary `vocab` and context `seq`.
    pub fn shaped(layers: usize, hidden: usize, vocab: usize, seq: usize) -> Result<Self> {
        if layers == 0 || hidden == 0 || vocab == 0 || seq == 0 {
            return Err(RunError::InvalidConfig(format!(
                "model shape: layers {layers}, hidden {hidden}, vocab {vocab}, seq {seq} must all be positive"
            )));
        }
        let n_head =
            [Self::HEAD_DIM, 64].into_iter().find(|d| hidden.is_multiple_of(*d)).map_or(1, |d| hidden / d);
        Ok(Self {
            gpt: GptConfig { vocab, seq_len: seq, d_model: hidden, n_head, n_layer: layers, mlp_ratio: 4 },
        })
    }

    /// Parameters.
    pub fn params(&self) -> usize {
        self.gpt.num_params()
    }

    /// FLOPs of one micro-batch of `batch` sequences (forward, backward, and
    /// the blocks' recomputation with checkpointing), split (forward, rest).
    pub fn flops(&self, batch: usize, checkpointing: bool) -> (f64, f64) {
        let g = &self.gpt;
        let (b, s, l, h, v, r) = (
            batch as f64,
            g.seq_len as f64,
            g.n_layer as f64,
            g.d_model as f64,
            g.vocab as f64,
            g.mlp_ratio as f64,
        );
        let blocks = (8.0 + 4.0 * r) * b * s * l * h * h + 4.0 * b * s * s * l * h;
        let head = 2.0 * b * s * h * v;
        let forward = blocks + head;
        let rest = 2.0 * forward + if checkpointing { blocks } else { 0.0 };
        (forward, rest)
    }
}

/// Everything a plan needs.
#[derive(Debug, Clone, PartialEq)]
pub struct PlanInput {
    /// The model.
    pub model: PlanModel,
    /// Tokens per GPU per micro-batch (a multiple of the context, or at most one context).
    pub tokens: usize,
    /// The cluster.
    pub cluster: Cluster,
    /// The GPU.
    pub gpu: GpuSpec,
    /// The time model's two constants.
    pub efficiency: Efficiency,
    /// Activation checkpointing (recompute the blocks' forward in backward).
    pub checkpointing: bool,
    /// How communication overlaps compute.
    pub overlap: Overlap,
    /// The modes to plan, in order.
    pub modes: Vec<PlanMode>,
}

/// One mode's plan, per GPU per optimizer step (one micro-batch of
/// [`PlanInput::tokens`]). For zeropp-delta the figures are the mean over its
/// refresh period: one full step per `refresh_every` steps, differences between.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModePlan {
    /// Step time, seconds.
    pub step_s: f64,
    /// Compute time, seconds.
    pub compute_s: f64,
    /// Exposed (not hidden) communication time per operation tag, seconds.
    pub exposed_s: BTreeMap<String, f64>,
    /// Model FLOP/s per GPU (the FLOPs of [`PlanModel::flops`] over the step), in TFLOP/s.
    pub tflops_per_gpu: f64,
    /// Bytes per GPU per step sent to GPUs of the same node.
    pub intra_node_bytes: f64,
    /// Bytes per GPU per step sent to GPUs of other nodes.
    pub inter_node_bytes: f64,
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
}

/// A plan: the modes' figures, keyed by mode name, with the inputs that made them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Plan {
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
    /// GPUs.
    pub gpus: usize,
    /// The GPU preset.
    pub gpu: String,
    /// The compute efficiency used.
    pub compute_efficiency: f64,
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
/// use zeropp_run::plan::{Cluster, Efficiency, GpuSpec, Overlap, PlanInput, PlanMode, PlanModel, plan};
/// let input = PlanInput {
///     model: PlanModel::from_params(1e9, 2048)?,
///     tokens: 2048,
///     cluster: Cluster { nodes: 4, gpus_per_node: 8, inter_bytes_per_s: 12.5e9, intra_bytes_per_s: 300e9, latency_s: 20e-6 },
///     gpu: GpuSpec::preset("a100").ok_or("preset")?,
///     efficiency: Efficiency::default(),
///     checkpointing: true,
///     overlap: Overlap::Prefetch,
///     modes: vec![PlanMode::Zero3, PlanMode::Zeropp],
/// };
/// let p = plan(&input)?;
/// let (z3, zpp) = (&p.modes["zero3"], &p.modes["zeropp"]);
/// assert!(zpp.inter_node_bytes < 0.3 * z3.inter_node_bytes);
/// assert!(zpp.step_s <= z3.step_s);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn plan(input: &PlanInput) -> Result<Plan> {
    let c = &input.cluster;
    if c.nodes == 0 || c.gpus_per_node == 0 {
        return Err(RunError::InvalidConfig("--nodes and --gpus-per-node must be positive".into()));
    }
    for (what, v) in [
        ("inter-node bandwidth", c.inter_bytes_per_s),
        ("intra-node bandwidth", c.intra_bytes_per_s),
        ("compute efficiency", input.efficiency.compute),
        ("link efficiency", input.efficiency.link),
        ("GPU peak", input.gpu.peak_flops),
        ("GPU memory bandwidth", input.gpu.hbm_bytes_per_s),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(RunError::InvalidConfig(format!("{what} must be positive, not {v}")));
        }
    }
    if !(c.latency_s.is_finite() && c.latency_s >= 0.0) {
        return Err(RunError::InvalidConfig(format!("latency must be at least 0, not {}", c.latency_s)));
    }
    if input.modes.is_empty() {
        return Err(RunError::InvalidConfig("--mode: no mode to plan".into()));
    }
    let mut model = input.model;
    let seq = model.gpt.seq_len.min(input.tokens.max(1));
    if input.tokens == 0 || input.tokens > seq && !input.tokens.is_multiple_of(seq) {
        return Err(RunError::InvalidConfig(format!(
            "--tokens {}: expected a positive multiple of the context ({seq}) or at most one context",
            input.tokens
        )));
    }
    model.gpt.seq_len = seq;
    let batch = input.tokens.div_ceil(seq);
    // The engine's GPT sizes its position table at most MAX_SEQ_LEN rows (its
    // training limit); a longer context's extra rows, `(seq - 1024)·h`
    // parameters (0.06% of a 7B model at 2048), are left out of the bytes and
    // the states. The activations are the engine's formula at the real context.
    let engine_seq = seq.min(GptConfig::MAX_SEQ_LEN);
    let gpt = Gpt::new(GptConfig { seq_len: engine_seq, ..model.gpt })?;
    let topo = Topology::ranks(c.world())
        .per_node(c.gpus_per_node)
        .map_err(|e| RunError::InvalidConfig(format!("cluster {} x {}: {e}", c.nodes, c.gpus_per_node)))?;
    let flops = model.flops(batch, input.checkpointing);
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
        let calls = time::calls_per_step(&cp);
        let mut kinds = vec![(StepKind::Full, 1.0)];
        if let Some(d) = cfg.zero.qwz_delta.filter(|d| d.refresh_every > 1 && cfg.zero.hpz_size > 1) {
            let r = d.refresh_every as f64;
            kinds = vec![(StepKind::Full, 1.0 / r), (StepKind::Delta, (r - 1.0) / r)];
        }
        let mut acc = StepTimes::default();
        let (mut intra, mut inter) = (0.0, 0.0);
        for (kind, weight) in kinds {
            let bytes = step_bytes_of(&pp, &cfg, 1, kind)?;
            let ops: Vec<OpTime> =
                bytes.by_op.iter().map(|(tag, b)| OpTime::of(tag, *b, &calls, input)).collect();
            // The embedding, the blocks and the head: one gather each.
            let t = StepTimes::of(&ops, flops, input, model.gpt.n_layer + 2);
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
                memory_bytes: mem.total() as f64,
                state_bytes: (mem.total() - mem.activations) as f64,
                speedup: first / step,
            },
        );
        order.push(mode.name().to_string());
    }
    Ok(Plan {
        params: model.params(),
        layers: model.gpt.n_layer,
        hidden: model.gpt.d_model,
        vocab: model.gpt.vocab,
        seq,
        tokens: input.tokens,
        gpus: c.world(),
        gpu: input.gpu.name.clone(),
        compute_efficiency: input.efficiency.compute,
        link_efficiency: input.efficiency.link,
        overlap: input.overlap,
        modes,
        order,
    })
}
