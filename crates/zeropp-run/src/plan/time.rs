//! The planner's time model over the engine's byte model: how communication
//! overlaps compute ([`Overlap`]), each operation's
//! time on the links ([`OpTime`]) and the step's compute and exposed
//! communication under ZeRO's prefetch ([`StepTimes`]); the formulas are in
//! the [parent module's docs](super).

use std::collections::BTreeMap;

use zeropp_engine::engine::bytes::StepKind;
use zeropp_engine::engine::{CommPlan, WeightGather, tags};
use zeropp_engine::metrics::LinkBytes;

use super::{Cluster, Efficiency, GpuSpec, Setting};
use crate::{Result, RunError};

/// How communication overlaps compute in the time model.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
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
    /// A measured share of the gathers' and reduce-scatters' time that stays
    /// exposed (0: all hidden, 1: as [`Overlap::None`]), for an engine whose
    /// own step split says how much it hides; the gradient norm's exchange
    /// and the persistent parameters' gather stay exposed whole, as in the
    /// other models.
    Exposed(f64),
}

impl Overlap {
    /// `--overlap`'s value: `prefetch`, `none`, or a measured exposed
    /// fraction from 0 to 1.
    ///
    /// ```
    /// use zeropp_run::plan::Overlap;
    /// assert_eq!(Overlap::parse("0.7")?, Overlap::Exposed(0.7));
    /// assert!(Overlap::parse("1.5").is_err());
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn parse(s: &str) -> Result<Self> {
        match s.trim() {
            "prefetch" => Ok(Self::Prefetch),
            "none" => Ok(Self::None),
            t => match t.parse::<f64>() {
                Ok(f) if (0.0..=1.0).contains(&f) => Ok(Self::Exposed(f)),
                _ => Err(RunError::InvalidConfig(format!(
                    "--overlap `{s}`: expected prefetch, none, or the exposed fraction of the \
                     communication, a number from 0 to 1"
                ))),
            },
        }
    }
}

/// What the time model reads of a plan's input: the links, the GPU, the
/// two efficiencies and the overlap.
#[derive(Debug, Clone, Copy)]
pub(super) struct Rates<'a> {
    pub(super) cluster: &'a Cluster,
    pub(super) gpu: &'a GpuSpec,
    pub(super) efficiency: Efficiency,
    pub(super) overlap: Overlap,
}

impl<'a> From<&'a Setting> for Rates<'a> {
    fn from(i: &'a Setting) -> Self {
        Self { cluster: &i.cluster, gpu: &i.gpu, efficiency: i.efficiency, overlap: i.overlap }
    }
}

/// Per operation tag: the collective calls of one step and the elements their
/// quantization kernels process.
#[derive(Debug, Default)]
pub(super) struct Calls {
    calls: BTreeMap<&'static str, f64>,
    quantized: BTreeMap<&'static str, f64>,
    /// Latency hops per world collective: 2 when it is routed over the rail
    /// and then the node, 1 flat.
    hops: f64,
    /// The forward gather's hops: 1 on qwZ-Δ's difference step, whose forward
    /// gathers from the hpZ copy inside the node.
    fwd_hops: f64,
    /// Hops of an operation that differs from the above (zeropp.torch's qgZ:
    /// two all-to-alls where FSDP2's calls are flat).
    hops_of: BTreeMap<&'static str, f64>,
}

/// The calls and kernel elements of one step of `kind` of `cp` (one micro-batch).
pub(super) fn calls_per_step(cp: &CommPlan, kind: StepKind) -> Calls {
    let t = cp.topology();
    let routed = cp.routing() == zeropp_comm::collectives::Routing::Hierarchical
        && t.nodes() > 1
        && t.local_size() > 1;
    let hpz = cp.hpz_size() > 1;
    let delta_step = kind == StepKind::Delta && cp.delta().is_some() && hpz;
    let hops = if routed { 2.0 } else { 1.0 };
    let mut c = Calls { hops, fwd_hops: if delta_step { 1.0 } else { hops }, ..Calls::default() };
    let qwz = matches!(cp.weights(), WeightGather::Qwz { .. });
    let add = |map: &mut BTreeMap<&'static str, f64>, tag: &'static str, v: f64| {
        *map.entry(tag).or_default() += v;
    };
    for layer in cp.layers().iter().filter(|l| l.padded_len > 0) {
        let p = layer.padded_len as f64;
        if layer.persistent {
            add(&mut c.calls, tags::PERSIST_GATHER, 1.0);
            continue;
        }
        add(&mut c.calls, tags::FWD_GATHER, 1.0);
        add(&mut c.calls, tags::BWD_GATHER, 1.0);
        add(&mut c.calls, tags::FWD_DELTA, 1.0);
        add(&mut c.calls, tags::GRAD_REDUCE, layer.reduces.len() as f64);
        if qwz {
            // The hpZ copy is dense unless it is held in INT8 (`--hpz-wire int8`).
            let bwd_dequantizes = !hpz || cp.hpz_int8();
            if !delta_step || cp.hpz_int8() {
                add(&mut c.quantized, tags::FWD_GATHER, p);
            }
            if bwd_dequantizes {
                add(&mut c.quantized, tags::BWD_GATHER, p);
            }
        }
        if delta_step {
            add(&mut c.quantized, tags::FWD_DELTA, p / cp.hpz_size().max(1) as f64);
        }
        if cp.qgz().is_some() {
            // Hop 1 quantizes the whole gradient; the fused kernels read it again.
            add(&mut c.quantized, tags::GRAD_REDUCE, 2.0 * p);
        }
    }
    add(&mut c.calls, tags::GRAD_NORM, 1.0);
    c
}

impl Calls {
    /// Flat calls (one hop each) of FSDP2's collectives: `calls` and
    /// `quantized` elements per operation tag, `hops_of` where a tag's calls
    /// take more than one hop.
    pub(super) fn flat(
        calls: BTreeMap<&'static str, f64>,
        quantized: BTreeMap<&'static str, f64>,
        hops_of: BTreeMap<&'static str, f64>,
    ) -> Self {
        Self { calls, quantized, hops: 1.0, fwd_hops: 1.0, hops_of }
    }

    /// Elements through the quantization kernels in the step, every operation.
    pub(super) fn quantized_elements(&self) -> f64 {
        self.quantized.values().sum()
    }
}

/// One operation's time on the links for a whole step.
#[derive(Debug, Clone)]
pub(super) struct OpTime {
    tag: String,
    seconds: f64,
}

impl OpTime {
    /// The time of operation `tag` moving `bytes` per GPU (see the module docs).
    pub(super) fn of(tag: &str, bytes: LinkBytes, calls: &Calls, input: &Rates<'_>) -> Self {
        let c = &input.cluster;
        let e = input.efficiency.link;
        let intra = bytes.intra / (c.intra_bytes_per_s * e);
        let inter = c.gpus_per_node as f64 * bytes.inter / (c.inter_bytes_per_s * e);
        let n = calls.calls.get(tag).copied().unwrap_or(0.0);
        let hops = match tag {
            t if calls.hops_of.contains_key(t) => calls.hops_of.get(t).copied().unwrap_or(1.0),
            t if t == tags::GRAD_NORM || t == tags::FWD_DELTA => 2.0,
            t if t == tags::FWD_GATHER => calls.fwd_hops,
            _ => calls.hops,
        };
        // An operation that moved nothing this step (hpZ's forward delta on a
        // full step) has no latency either.
        let latency = if bytes.intra + bytes.inter > 0.0 { n * hops * c.latency_s } else { 0.0 };
        let kernel = calls.quantized.get(tag).copied().unwrap_or(0.0) / input.gpu.kernel_elements_per_s;
        Self { tag: tag.to_string(), seconds: intra.max(inter) + latency + kernel }
    }
}

/// A step's compute and exposed communication, seconds.
#[derive(Debug, Default, Clone)]
pub(super) struct StepTimes {
    pub(super) compute: f64,
    pub(super) exposed: BTreeMap<String, f64>,
}

impl StepTimes {
    /// The step of `ops` with `compute` seconds (forward, the rest) under
    /// the prefetch overlap of `stages` layers.
    pub(super) fn of(ops: &[OpTime], compute: (f64, f64), input: &Rates<'_>, stages: usize) -> Self {
        let (cf, cb) = compute;
        // Without overlap nothing hides: one stage, no compute under it.
        let (n, hide) = match input.overlap {
            Overlap::Prefetch => (stages.max(1) as f64, 1.0),
            Overlap::None | Overlap::Exposed(_) => (1.0, 0.0),
        };
        // A measured exposed fraction scales what no overlap would expose.
        let share = match input.overlap {
            Overlap::Exposed(f) => f,
            Overlap::Prefetch | Overlap::None => 1.0,
        };
        let forward = |t: &str| t == tags::FWD_GATHER || t == tags::FWD_DELTA;
        let backward = |t: &str| t == tags::BWD_GATHER || t == tags::GRAD_REDUCE;
        let mut exposed = BTreeMap::new();
        for (hidden_by, side) in [(hide * cf, &forward as &dyn Fn(&str) -> bool), (hide * cb, &backward)] {
            let total: f64 = ops.iter().filter(|o| side(&o.tag)).map(|o| o.seconds).sum();
            if total <= 0.0 {
                continue;
            }
            // n stages of gather g and compute c, prefetched one ahead: the first
            // gather is exposed, then each stage's max(0, g - c).
            let e = share * (total / n + (n - 1.0) / n * (total - hidden_by).max(0.0));
            for o in ops.iter().filter(|o| side(&o.tag)) {
                *exposed.entry(o.tag.clone()).or_default() += e * o.seconds / total;
            }
        }
        for o in ops.iter().filter(|o| !forward(&o.tag) && !backward(&o.tag)) {
            *exposed.entry(o.tag.clone()).or_default() += o.seconds;
        }
        Self { compute: cf + cb, exposed }
    }

    /// Adds `weight` times `other` (a mean over step kinds).
    pub(super) fn add(&mut self, other: &StepTimes, weight: f64) {
        self.compute += weight * other.compute;
        for (k, v) in &other.exposed {
            *self.exposed.entry(k.clone()).or_default() += weight * v;
        }
    }

    /// Compute plus everything exposed.
    pub(super) fn step(&self) -> f64 {
        self.compute + self.exposed.values().sum::<f64>()
    }
}
