//! Engine configuration: the ZeRO stage, the ZeRO++ switches, batch arithmetic
//! and the optimizer.
//!
//! [`EngineConfig`] is what the per-rank engine needs; it can be built by hand,
//! from the CLI flags, or from a DeepSpeed JSON file ([`crate::deepspeed`]).

use serde::{Deserialize, Serialize};
pub use zeropp_comm::collectives::Routing;

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
}

impl Default for LocoConfig {
    /// DeepSpeed's defaults: `err_beta` 0.8, `reset_T` 1024.
    fn default() -> Self {
        Self { err_beta: 0.8, reset_t: 1024 }
    }
}

/// The ZeRO stage and the ZeRO++ techniques, each switchable on its own.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ZeroConfig {
    /// ZeRO stage; only 3 is supported.
    pub stage: u8,
    /// qwZ: quantized weight all-gather in the forward pass.
    pub qwz: bool,
    /// Bits of the qwZ quantization (8 or 4).
    pub qwz_bits: u8,
    /// Elements per quantization group of qwZ.
    pub qwz_group_size: usize,
    /// hpZ partition size: ranks per secondary-shard group (1 = hpZ off).
    /// Must divide the node size.
    pub hpz_size: usize,
    /// qgZ: hierarchical quantized gradient reduce-scatter.
    pub qgz: bool,
    /// Bits of the qgZ quantization (4 or 8).
    pub qgz_bits: u8,
    /// Elements per quantization group of qgZ.
    pub qgz_group_size: usize,
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
    /// qgZ error feedback, LoCo style, on both quantizing hops (`None` = off; see
    /// [`LocoConfig`] and `zeropp_comm::collectives::ErrorFeedback`).
    pub error_feedback: Option<LocoConfig>,
    /// Reduce 1-D parameters (biases, LayerNorm gains and shifts) at full
    /// precision under qgZ, as DeepSpeed does, instead of through INT4: their
    /// gradients go to their owners in the baseline type (a small all-to-all-v,
    /// routed like qgZ: inside the node, then over the rail), while qgZ
    /// carries the matrices (with zeros where the 1-D parameters are).
    #[serde(default)]
    pub qgz_exclude_1d: bool,
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
}

fn yes() -> bool {
    true
}

impl ZeroConfig {
    /// Plain ZeRO-3: every ZeRO++ technique off, 16-bit (bf16) communication.
    pub fn zero3() -> Self {
        Self {
            stage: 3,
            qwz: false,
            qwz_bits: 8,
            qwz_group_size: 256,
            hpz_size: 1,
            qgz: false,
            qgz_bits: 4,
            qgz_group_size: 256,
            comm_dtype: CommDtype::Bf16,
            routing: Routing::Hierarchical,
            hpz_wire: HpzWire::Dense,
            error_feedback: None,
            qgz_exclude_1d: false,
            stochastic_rounding: false,
            prefetch: true,
            per_tensor_groups: true,
        }
    }

    /// Full ZeRO++ with its default options: qwZ INT8, hpZ over the node
    /// (`local_size` ranks), qgZ INT4 with LoCo error feedback on both hops and
    /// the 1-D parameters reduced at the baseline precision (DeepSpeed's choices).
    ///
    /// The two qgZ options are on because they gave the best fidelity in
    /// `cargo xtask bench fidelity` (docs/PERFORMANCE.md: mean validation-loss
    /// ratio to ZeRO-3 of 1.0007 over 5 seeds on tinyshakespeare, against 1.0132
    /// without them); both are cheap (the 1-D parameters are a few per cent of a
    /// small model and well under 1% of a large one).
    pub fn zeropp(local_size: usize) -> Self {
        Self {
            qwz: true,
            hpz_size: local_size.max(1),
            qgz: true,
            error_feedback: Some(LocoConfig::default()),
            qgz_exclude_1d: true,
            ..Self::zero3()
        }
    }

    /// [`ZeroConfig::zeropp`] as the ZeRO++ paper describes it: the three
    /// techniques alone, without LoCo or the 1-D exclusion.
    pub fn zeropp_plain(local_size: usize) -> Self {
        Self { error_feedback: None, qgz_exclude_1d: false, ..Self::zeropp(local_size) }
    }

    /// True when hpZ is on (`hpz_size > 1`).
    pub fn hpz(&self) -> bool {
        self.hpz_size > 1
    }

    /// A short label: `zero3`, `zeropp`, or the enabled techniques (`qwz+hpz`).
    pub fn label(&self) -> String {
        let mut parts = Vec::new();
        if self.qwz {
            parts.push("qwz");
        }
        if self.hpz() {
            parts.push("hpz");
        }
        if self.qgz {
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
        for (name, on, bits, group) in [
            ("qwZ", self.qwz, self.qwz_bits, self.qwz_group_size),
            ("qgZ", self.qgz, self.qgz_bits, self.qgz_group_size),
        ] {
            if on && !matches!(bits, 4 | 8) {
                return Err(EngineError::InvalidConfig(format!("{name} bits must be 4 or 8, got {bits}")));
            }
            if on && (group == 0 || !group.is_multiple_of(2)) {
                return Err(EngineError::InvalidConfig(format!(
                    "{name} group size must be a positive even number, got {group}"
                )));
            }
        }
        if let Some(l) = self.error_feedback
            && !(l.err_beta.is_finite() && (0.0..1.0).contains(&l.err_beta))
        {
            return Err(EngineError::InvalidConfig(format!(
                "LoCo err_beta must be in [0, 1), got {}",
                l.err_beta
            )));
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
        assert_eq!(ZeroConfig { qwz: true, ..ZeroConfig::zero3() }.label(), "qwz");
    }
}
