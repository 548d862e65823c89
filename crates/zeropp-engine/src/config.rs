//! Engine configuration: the ZeRO stage, the ZeRO++ switches, batch arithmetic
//! and the optimizer.
//!
//! [`EngineConfig`] is what the per-rank engine needs; it can be built by hand,
//! from the CLI flags, or from a DeepSpeed JSON file ([`crate::deepspeed`]).

use serde::{Deserialize, Serialize};
pub use zeropp_comm::collectives::Routing;
pub use zeropp_comm::quant::QuantSpec;
use zeropp_comm::quant::{Bits, Scheme};

use crate::EngineError;

/// How the hpZ secondary shard is held and gathered in the backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum HpzWire {
    /// In the baseline element type ([`CommDtype`], bf16 by default): the
    /// gathered weights as the forward pass used them. `2·Ψ/hpz` bytes held.
    #[default]
    Dense,
    /// As the qwZ INT8 encodings the forward gather received (DeepSpeed's choice
    /// when qwZ is on): about half the bytes held and sent, the same weights (they
    /// are the same bytes). Needs qwZ; without it the dense wire is used.
    Int8,
}

impl HpzWire {
    /// The lower-case name (`dense`, `int8`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Dense => "dense",
            Self::Int8 => "int8",
        }
    }
}

impl std::str::FromStr for HpzWire {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "dense" | "bf16" | "16bit" => Ok(Self::Dense),
            "int8" => Ok(Self::Int8),
            other => Err(EngineError::InvalidConfig(format!(
                "unknown hpZ wire `{other}` (expected dense or int8)"
            ))),
        }
    }
}

/// Serde for [`Routing`] (a comm type) as its name.
mod routing_serde {
    use serde::{Deserialize, Deserializer, Serializer};
    use zeropp_comm::collectives::Routing;

    pub(super) fn serialize<S: Serializer>(r: &Routing, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(r.name())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Routing, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// The element type the baseline (non-quantized) collectives put on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CommDtype {
    /// bfloat16: what ZeRO-3 sends with `bf16.enabled` (the default).
    #[default]
    Bf16,
    /// f32: exact communication, used by the equivalence tests.
    F32,
}

impl CommDtype {
    /// The comm crate's name for this wire type.
    pub fn wire(self) -> zeropp_comm::collectives::DenseWire {
        match self {
            Self::Bf16 => zeropp_comm::collectives::DenseWire::Bf16,
            Self::F32 => zeropp_comm::collectives::DenseWire::F32,
        }
    }

    /// Bytes per element on the wire.
    pub fn bytes(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::F32 => 4,
        }
    }

    /// The lower-case name (`bf16`, `f32`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::F32 => "f32",
        }
    }
}

impl std::str::FromStr for CommDtype {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "bf16" | "bfloat16" => Ok(Self::Bf16),
            "f32" | "fp32" | "float32" => Ok(Self::F32),
            other => Err(EngineError::InvalidConfig(format!(
                "unknown communication dtype `{other}` (expected bf16 or f32)"
            ))),
        }
    }
}

/// LoCo error feedback for qgZ (DeepSpeed's `zeropp_loco_param`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LocoConfig {
    /// Moving-average factor of the residual: `e ← β·e + (1 − β)·(new error)`
    /// (`err_beta`; 0 = plain error feedback). In `[0, 1)`.
    pub err_beta: f32,
    /// Every `reset_t` optimizer steps the residuals are reset to zero (`reset_T`;
    /// 0 = never). DeepSpeed counts this in calls of its reduce (one per parameter
    /// per step); here it counts optimizer steps.
    pub reset_t: usize,
    /// How the residuals are stored: bf16 (the default; half the memory, as
    /// DeepSpeed keeps its error buffers in the 16-bit dtype) or f32.
    #[serde(default)]
    pub residual_dtype: CommDtype,
}

impl LocoConfig {
    /// The comm crate's storage precision for [`LocoConfig::residual_dtype`].
    pub fn residual_precision(&self) -> zeropp_comm::collectives::ResidualPrecision {
        match self.residual_dtype {
            CommDtype::Bf16 => zeropp_comm::collectives::ResidualPrecision::Bf16,
            CommDtype::F32 => zeropp_comm::collectives::ResidualPrecision::F32,
        }
    }
}

impl Default for LocoConfig {
    /// DeepSpeed's defaults: `err_beta` 0.8, `reset_T` 1024; residuals in bf16.
    fn default() -> Self {
        Self { err_beta: 0.8, reset_t: 1024, residual_dtype: CommDtype::Bf16 }
    }
}

/// Elements per quantization group of the default qwZ and qgZ specs (and the
/// shard alignment of a technique that is off).
pub const DEFAULT_GROUP_SIZE: usize = 256;

/// The symmetric quantization spec of `bits` (4 or 8) with `group_size`
/// elements per scale, checked as ZeRO++ needs it: `name` (`qwZ`, `qgZ`) names
/// the technique in the errors. This is where specs from flags and files are built.
///
/// ```
/// use zeropp_engine::config::quant_spec;
/// assert_eq!(quant_spec("qgZ", 4, 128).unwrap().group_size(), 128);
/// assert!(quant_spec("qgZ", 3, 128).is_err());
/// assert!(quant_spec("qwZ", 8, 7).is_err());
/// ```
pub fn quant_spec(name: &str, bits: u8, group_size: usize) -> Result<QuantSpec, EngineError> {
    let b = match bits {
        4 => Bits::Int4,
        8 => Bits::Int8,
        _ => return Err(EngineError::InvalidConfig(format!("{name} bits must be 4 or 8, got {bits}"))),
    };
    check_group(name, group_size)?;
    QuantSpec::new(b, Scheme::Symmetric, group_size).map_err(EngineError::InvalidQuantSpec)
}

fn check_group(name: &str, group: usize) -> Result<(), EngineError> {
    if group == 0 || !group.is_multiple_of(2) {
        return Err(EngineError::InvalidConfig(format!(
            "{name} group size must be a positive even number, got {group}"
        )));
    }
    Ok(())
}

/// A spec built by hand ([`QuantSpec::new`]) can still have an odd group size
/// (or, one day, another width): the same checks as [`quant_spec`].
fn check_spec(name: &str, spec: &QuantSpec) -> Result<(), EngineError> {
    let bits = spec.bits().bits();
    if !matches!(bits, 4 | 8) {
        return Err(EngineError::InvalidConfig(format!("{name} bits must be 4 or 8, got {bits}")));
    }
    check_group(name, spec.group_size())
}

/// A default spec (symmetric, [`DEFAULT_GROUP_SIZE`]), infallible.
fn default_spec(bits: Bits) -> QuantSpec {
    match QuantSpec::new(bits, Scheme::Symmetric, DEFAULT_GROUP_SIZE) {
        Ok(s) => s,
        Err(_) => unreachable!("the default group size is valid"),
    }
}

/// Serde for [`QuantSpec`] (a quant type without serde): `{bits, scheme, group_size}`.
mod spec_serde {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};
    use zeropp_quant::{Bits, QuantSpec, Scheme};

    #[derive(Serialize, Deserialize)]
    struct Repr {
        bits: u32,
        scheme: String,
        group_size: usize,
    }

    fn repr(s: &QuantSpec) -> Repr {
        let scheme = if s.scheme().has_offsets() { "asym" } else { "sym" };
        Repr { bits: s.bits().bits(), scheme: scheme.to_string(), group_size: s.group_size() }
    }

    fn spec<E: serde::de::Error>(r: Repr) -> Result<QuantSpec, E> {
        let bits = Bits::from_bits(r.bits).map_err(E::custom)?;
        let scheme: Scheme = r.scheme.parse().map_err(E::custom)?;
        QuantSpec::new(bits, scheme, r.group_size).map_err(E::custom)
    }

    pub(super) fn serialize<S: Serializer>(s: &QuantSpec, ser: S) -> Result<S::Ok, S::Error> {
        repr(s).serialize(ser)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<QuantSpec, D::Error> {
        spec(Repr::deserialize(d)?)
    }

    /// The same for an optional spec (`null` = off).
    pub(super) mod option {
        use super::*;

        pub(crate) fn serialize<S: Serializer>(s: &Option<QuantSpec>, ser: S) -> Result<S::Ok, S::Error> {
            s.as_ref().map(repr).serialize(ser)
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<QuantSpec>, D::Error> {
            Option::<Repr>::deserialize(d)?.map(spec).transpose()
        }
    }
}

/// qgZ, the hierarchical quantized gradient reduce-scatter, and its options.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct QgzConfig {
    /// The quantization of both quantizing hops (INT4, groups of 256 by default).
    /// The intra-node reduction in between is INT8 with the same group size.
    #[serde(with = "spec_serde")]
    pub spec: QuantSpec,
    /// Error feedback, LoCo style, on both quantizing hops (`None` = off; see
    /// [`LocoConfig`] and `zeropp_comm::collectives::ErrorFeedback`).
    pub error_feedback: Option<LocoConfig>,
    /// Reduce 1-D parameters (biases, LayerNorm gains and shifts) at full
    /// precision, as DeepSpeed does, instead of through INT4: their gradients go
    /// to their owners in the baseline type (a small all-to-all-v, routed like
    /// qgZ: inside the node, then over the rail), while qgZ carries the matrices
    /// (with zeros where the 1-D parameters are).
    #[serde(default)]
    pub exclude_1d: bool,
    /// Stochastic rounding in qgZ's quantizers (both hops), seeded and
    /// deterministic: every gradient value rounds up or down with the
    /// probability that makes the rounding unbiased, so small gradient
    /// components survive INT4 in expectation instead of rounding to zero.
    /// ([`ZeroConfig::stochastic_rounding`] turns it on for every quantizer,
    /// qwZ's too.)
    #[serde(default)]
    pub stochastic: bool,
}

impl QgzConfig {
    /// qgZ as the ZeRO++ paper describes it: `spec` alone, no error feedback,
    /// the 1-D parameters quantized like the matrices, round to nearest.
    pub fn plain(spec: QuantSpec) -> Self {
        Self { spec, error_feedback: None, exclude_1d: false, stochastic: false }
    }

    /// qgZ with the default options of [`ZeroConfig::zeropp`]: the 1-D
    /// parameters at the baseline precision and stochastic rounding, no error
    /// feedback (the variant that met the fidelity rule on every corpus
    /// measured; docs/PERFORMANCE.md, "Fidelity").
    pub fn with_options(spec: QuantSpec) -> Self {
        Self { spec, error_feedback: None, exclude_1d: true, stochastic: true }
    }

    /// qgZ as DeepSpeed's LoCo-ZeRO++ configures it: LoCo error feedback (its
    /// defaults), the 1-D parameters at the baseline precision, round to nearest
    /// (this crate's default before the fidelity study; opt-in now).
    pub fn loco(spec: QuantSpec) -> Self {
        Self { spec, error_feedback: Some(LocoConfig::default()), exclude_1d: true, stochastic: false }
    }
}

impl Default for QgzConfig {
    /// INT4, groups of [`DEFAULT_GROUP_SIZE`], without the options ([`QgzConfig::plain`]).
    fn default() -> Self {
        Self::plain(ZeroConfig::default_qgz_spec())
    }
}

/// The ZeRO stage and the ZeRO++ techniques, each switchable on its own; a
/// technique that is off carries no parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ZeroConfig {
    /// ZeRO stage; only 3 is supported.
    pub stage: u8,
    /// qwZ, the quantized weight all-gather of the forward pass, with its spec
    /// (INT8, groups of 256 by default); `None` = off.
    #[serde(default, with = "spec_serde::option")]
    pub qwz: Option<QuantSpec>,
    /// hpZ partition size: ranks per secondary-shard group (1 = hpZ off).
    /// Must divide the node size.
    pub hpz_size: usize,
    /// qgZ and its options; `None` = off.
    #[serde(default)]
    pub qgz: Option<QgzConfig>,
    /// Element type of the baseline collectives.
    pub comm_dtype: CommDtype,
    /// Routing of every world collective (the dense ZeRO-3 gathers and
    /// reduce-scatters, and ZeRO++'s qwZ gathers): hierarchical (inter-node hop
    /// over the rail, then intra-node, as NCCL and torch HSDP route; the default)
    /// or flat (every rank with every rank). qgZ is hierarchical by construction.
    #[serde(default, with = "routing_serde")]
    pub routing: Routing,
    /// How hpZ holds and gathers its secondary shard (see [`HpzWire`]).
    #[serde(default)]
    pub hpz_wire: HpzWire,
    /// Stochastic rounding in the quantizers (seeded, deterministic).
    pub stochastic_rounding: bool,
    /// Prefetch the next layer's forward gather while the current layer computes.
    pub prefetch: bool,
    /// Quantization groups never straddle two parameters: each parameter starts
    /// at a multiple of the group size inside its layer's flat buffer (zero
    /// padding in between), so each tensor gets its own scales, as in DeepSpeed.
    /// Off, a group can hold the tail of one tensor and the head of the next
    /// (e.g. a LayerNorm gain of 1.0 next to weights of 0.02, whose INT8 step then
    /// becomes 1/127). Applies to every mode, so all modes pad the model alike.
    #[serde(default = "yes")]
    pub per_tensor_groups: bool,
    /// DeepSpeed's stage-3 bucket knobs (all off by default).
    #[serde(default)]
    pub buckets: BucketKnobs,
}

/// DeepSpeed's stage-3 bucket and prefetch knobs, in elements, mapped onto this
/// engine's schedule (`zero_optimization.*` in a DeepSpeed file, or flags).
///
/// | knob | effect here |
/// |---|---|
/// | `param_persistence_threshold` | parameters of at most this many elements leave their layer's bucket for one `persistent` bucket: gathered once per step (`persist_gather`, after the update) and kept whole on every rank, never gathered per layer; their gradients are reduced together once per micro-batch |
/// | `prefetch_bucket_size` | a layer's gather is prefetched only when its padded size is at most this (`Some(0)`: no prefetch) |
/// | `max_live_parameters` | a prefetch is issued only when the gathered layer in use plus the prefetched one stay within this many elements |
/// | `reduce_bucket_size` | a layer's gradient is reduced in calls of at most this many padded elements (each call its own collective, headers and scales) |
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct BucketKnobs {
    /// `reduce_bucket_size`: most padded elements per gradient reduce call
    /// (`None`: one call per layer).
    #[serde(default)]
    pub reduce_bucket_size: Option<usize>,
    /// `stage3_prefetch_bucket_size`: largest layer (padded elements) that is
    /// prefetched (`None`: any; `Some(0)`: none).
    #[serde(default)]
    pub prefetch_bucket_size: Option<usize>,
    /// `stage3_param_persistence_threshold`: parameters with at most this many
    /// elements are persistent (0: none; DeepSpeed's default is 100000).
    #[serde(default)]
    pub param_persistence_threshold: usize,
    /// `stage3_max_live_parameters`: most gathered elements alive at once when
    /// deciding a prefetch (`None`: unlimited).
    #[serde(default)]
    pub max_live_parameters: Option<usize>,
}

fn yes() -> bool {
    true
}

impl ZeroConfig {
    /// Plain ZeRO-3: every ZeRO++ technique off, 16-bit (bf16) communication.
    pub fn zero3() -> Self {
        Self {
            stage: 3,
            qwz: None,
            hpz_size: 1,
            qgz: None,
            comm_dtype: CommDtype::Bf16,
            routing: Routing::Hierarchical,
            hpz_wire: HpzWire::Dense,
            stochastic_rounding: false,
            prefetch: true,
            per_tensor_groups: true,
            buckets: BucketKnobs::default(),
        }
    }

    /// Full ZeRO++ with its default options: qwZ INT8, hpZ over the node
    /// (`local_size` ranks), qgZ INT4 with LoCo error feedback on both hops and
    /// the 1-D parameters reduced at the baseline precision (DeepSpeed's choices,
    /// [`QgzConfig::with_options`]).
    ///
    /// The two qgZ options are on because they gave the best fidelity in
    /// `cargo xtask bench fidelity` (docs/PERFORMANCE.md: mean validation-loss
    /// ratio to ZeRO-3 of 1.0007 over 5 seeds on tinyshakespeare, against 1.0132
    /// without them); both are cheap (the 1-D parameters are a few per cent of a
    /// small model and well under 1% of a large one).
    pub fn zeropp(local_size: usize) -> Self {
        Self {
            qwz: Some(Self::default_qwz_spec()),
            hpz_size: local_size.max(1),
            qgz: Some(QgzConfig::with_options(Self::default_qgz_spec())),
            ..Self::zero3()
        }
    }

    /// [`ZeroConfig::zeropp`] as the ZeRO++ paper describes it: the three
    /// techniques alone, without LoCo or the 1-D exclusion ([`QgzConfig::plain`]).
    pub fn zeropp_plain(local_size: usize) -> Self {
        Self { qgz: Some(QgzConfig::default()), ..Self::zeropp(local_size) }
    }

    /// qwZ's default spec: symmetric INT8, groups of [`DEFAULT_GROUP_SIZE`].
    pub fn default_qwz_spec() -> QuantSpec {
        default_spec(Bits::Int8)
    }

    /// qgZ's default spec: symmetric INT4, groups of [`DEFAULT_GROUP_SIZE`].
    pub fn default_qgz_spec() -> QuantSpec {
        default_spec(Bits::Int4)
    }

    /// This config with qwZ on at `spec`.
    pub fn with_qwz(self, spec: QuantSpec) -> Self {
        Self { qwz: Some(spec), ..self }
    }

    /// This config with qgZ on as `qgz`.
    pub fn with_qgz(self, qgz: QgzConfig) -> Self {
        Self { qgz: Some(qgz), ..self }
    }

    /// This config with hpZ groups of `hpz_size` ranks (1 = off).
    pub fn with_hpz(self, hpz_size: usize) -> Self {
        Self { hpz_size, ..self }
    }

    /// True when hpZ is on (`hpz_size > 1`).
    pub fn hpz(&self) -> bool {
        self.hpz_size > 1
    }

    /// qgZ's error feedback (`None` when qgZ or the feedback is off).
    pub fn error_feedback(&self) -> Option<LocoConfig> {
        self.qgz.and_then(|q| q.error_feedback)
    }

    /// True when qgZ is on and reduces the 1-D parameters at the baseline precision.
    pub fn exclude_1d(&self) -> bool {
        self.qgz.is_some_and(|q| q.exclude_1d)
    }

    /// True when qgZ is on and rounds stochastically (its own option or
    /// [`ZeroConfig::stochastic_rounding`]).
    pub fn qgz_stochastic(&self) -> bool {
        self.qgz.is_some_and(|q| q.stochastic || self.stochastic_rounding)
    }

    /// The group sizes the shards are aligned to: qwZ's and qgZ's, or
    /// [`DEFAULT_GROUP_SIZE`] for a technique that is off.
    pub fn group_sizes(&self) -> (usize, usize) {
        (
            self.qwz.map_or(DEFAULT_GROUP_SIZE, |s| s.group_size()),
            self.qgz.map_or(DEFAULT_GROUP_SIZE, |q| q.spec.group_size()),
        )
    }

    /// A short label: `zero3`, `zeropp`, or the enabled techniques (`qwz+hpz`).
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if self.qwz.is_some() {
            parts.push("qwz");
        }
        if self.hpz() {
            parts.push("hpz");
        }
        if self.qgz.is_some() {
            parts.push("qgz");
        }
        match parts.len() {
            0 => "zero3".to_string(),
            3 => "zeropp".to_string(),
            _ => parts.join("+"),
        }
    }

    /// Checks the switches against a cluster of `world` ranks, `local_size` per node.
    pub fn validate(&self, world: usize, local_size: usize) -> Result<(), EngineError> {
        if self.stage != 3 {
            return Err(EngineError::InvalidConfig(format!(
                "ZeRO stage {} is not supported: this engine implements stage 3 (with ZeRO++)",
                self.stage
            )));
        }
        if world == 0 || local_size == 0 || !world.is_multiple_of(local_size) {
            return Err(EngineError::InvalidConfig(format!(
                "world {world} is not divisible into nodes of {local_size} ranks"
            )));
        }
        if self.hpz_size == 0 || !local_size.is_multiple_of(self.hpz_size) {
            return Err(EngineError::InvalidConfig(format!(
                "hpZ partition size {} must be >= 1 and divide the node size {local_size}",
                self.hpz_size
            )));
        }
        if let Some(s) = &self.qwz {
            check_spec("qwZ", s)?;
        }
        if let Some(q) = &self.qgz {
            check_spec("qgZ", &q.spec)?;
        }
        if let Some(l) = self.error_feedback()
            && !(l.err_beta.is_finite() && (0.0..1.0).contains(&l.err_beta))
        {
            return Err(EngineError::InvalidConfig(format!(
                "LoCo err_beta must be in [0, 1), got {}",
                l.err_beta
            )));
        }
        if let Some(r) = self.buckets.reduce_bucket_size {
            let (a, b) = self.group_sizes();
            let min = world * a.max(b);
            if r < min {
                return Err(EngineError::InvalidConfig(format!(
                    "reduce_bucket_size {r} is below one quantization group per rank ({world} ranks x {} = {min} elements)",
                    a.max(b)
                )));
            }
        }
        Ok(())
    }
}

impl Default for ZeroConfig {
    fn default() -> Self {
        Self::zero3()
    }
}

/// AdamW hyper-parameters (decoupled weight decay, bias-corrected moments).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay (0 = Adam).
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self { lr: 3e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.0 }
    }
}

/// Everything the per-rank engine needs besides the model and the cluster.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// ZeRO stage and ZeRO++ switches.
    pub zero: ZeroConfig,
    /// Optimizer.
    pub optim: AdamWConfig,
    /// Sequences per optimizer step over all ranks (`micro_batch * grad_accum * world`).
    pub global_batch: usize,
    /// Micro-batches accumulated per optimizer step.
    pub grad_accum: usize,
    /// Global-norm gradient clipping threshold (`None` or 0 = off).
    pub gradient_clipping: Option<f32>,
    /// Seed of the parameter initialisation, the data order and stochastic rounding.
    pub seed: u64,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            zero: ZeroConfig::default(),
            optim: AdamWConfig::default(),
            global_batch: 16,
            grad_accum: 1,
            gradient_clipping: Some(1.0),
            seed: 0,
        }
    }
}

impl EngineConfig {
    /// Sequences per rank per micro-batch; an error when the global batch does not
    /// split evenly over `world` ranks and `grad_accum` micro-batches.
    pub fn micro_batch(&self, world: usize) -> Result<usize, EngineError> {
        if world == 0 || self.grad_accum == 0 || self.global_batch == 0 {
            return Err(EngineError::InvalidConfig(format!(
                "global batch {}, gradient accumulation {} and world {world} must all be positive",
                self.global_batch, self.grad_accum
            )));
        }
        let per_step = world * self.grad_accum;
        if !self.global_batch.is_multiple_of(per_step) {
            return Err(EngineError::InvalidConfig(format!(
                "global batch {} is not divisible by world {world} x gradient accumulation {}",
                self.global_batch, self.grad_accum
            )));
        }
        Ok(self.global_batch / per_step)
    }

    /// Validates the whole configuration against a cluster shape.
    pub fn validate(&self, world: usize, local_size: usize) -> Result<(), EngineError> {
        self.zero.validate(world, local_size)?;
        self.micro_batch(world)?;
        let o = &self.optim;
        let finite = [o.lr, o.beta1, o.beta2, o.eps, o.weight_decay].iter().all(|v| v.is_finite());
        if !finite
            || o.lr < 0.0
            || !(0.0..1.0).contains(&o.beta1)
            || !(0.0..1.0).contains(&o.beta2)
            || o.eps <= 0.0
        {
            return Err(EngineError::InvalidConfig(format!("invalid AdamW parameters {o:?}")));
        }
        if let Some(c) = self.gradient_clipping
            && (!c.is_finite() || c < 0.0)
        {
            return Err(EngineError::InvalidConfig(format!("gradient clipping must be >= 0, got {c}")));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_arithmetic() {
        let c = EngineConfig { global_batch: 32, grad_accum: 2, ..EngineConfig::default() };
        assert_eq!(c.micro_batch(8).unwrap(), 2);
        assert!(c.micro_batch(3).is_err());
        assert!(c.validate(8, 4).is_ok());
        assert!(c.validate(8, 3).is_err());
    }

    #[test]
    fn hpz_must_divide_node() {
        let z = ZeroConfig { hpz_size: 3, ..ZeroConfig::zeropp(4) };
        assert!(z.validate(8, 4).is_err());
        assert!(ZeroConfig::zeropp(4).validate(8, 4).is_ok());
        assert_eq!(ZeroConfig::zeropp(4).label(), "zeropp");
        assert_eq!(ZeroConfig::zero3().with_qwz(ZeroConfig::default_qwz_spec()).label(), "qwz");
    }

    #[test]
    fn specs_are_checked() {
        assert!(quant_spec("qwZ", 4, 64).is_ok());
        let e = quant_spec("qgZ", 5, 64).unwrap_err().to_string();
        assert!(e.contains("qgZ bits must be 4 or 8, got 5"), "{e}");
        let e = quant_spec("qwZ", 8, 0).unwrap_err().to_string();
        assert!(e.contains("qwZ group size must be a positive even number, got 0"), "{e}");
        // A hand-built spec with an odd group size is still caught by validate.
        let odd = ZeroConfig::zero3().with_qwz(QuantSpec::int8(7).unwrap());
        assert!(odd.validate(8, 4).is_err());
    }

    #[test]
    fn serde_round_trip() {
        for z in [ZeroConfig::zero3(), ZeroConfig::zeropp(4), ZeroConfig::zeropp_plain(2)] {
            let j = serde_json::to_string(&z).unwrap();
            assert_eq!(serde_json::from_str::<ZeroConfig>(&j).unwrap(), z, "{j}");
        }
    }
}
