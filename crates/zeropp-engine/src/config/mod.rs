//! Engine configuration: the ZeRO stage, the ZeRO++ switches, batch arithmetic
//! and the optimizer.
//!
//! [`EngineConfig`] is what the per-rank engine needs; it can be built by hand,
//! from the CLI flags, or from a DeepSpeed JSON file (zeropp-run's `deepspeed` reader). One
//! file per part: `zero.rs` ([`ZeroConfig`]: the stage, the techniques and
//! DeepSpeed's bucket knobs), `delta.rs` (qwZ-Δ's [`DeltaConfig`]), `spec.rs` (quantization specs as ZeRO++ checks them, and
//! their serde), `wire.rs` (the element types on the wire: [`CommDtype`],
//! [`HpzWire`]); this file holds the run-level [`EngineConfig`] and
//! [`AdamWConfig`].
//!
//! qgZ's settings are comm's own types ([`QgzConfig`], [`LocoConfig`],
//! re-exported here): the engine carries them as they are and takes every
//! call's options from [`QgzConfig::options`].

use serde::{Deserialize, Serialize};
pub use zeropp_comm::collectives::Routing;
pub use zeropp_comm::quant::QuantSpec;

use crate::EngineError;

mod delta;
mod spec;
mod wire;
mod zero;

pub use delta::DeltaConfig;
pub use spec::{DEFAULT_GROUP_SIZE, quant_spec};
pub use wire::{CommDtype, HpzWire};
pub use zero::{BucketKnobs, ZeroConfig};
pub use zeropp_comm::collectives::{LocoConfig, QgzConfig, ResidualPrecision};

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
