//! AdamW on f32 master shards.
//!
//! The update is element-wise, so running it on every rank's shard of the flat
//! parameters gives bit-for-bit the same result as running it once on the whole
//! vector: the single-rank reference and the sharded engine share this code.

use crate::EngineError;
use crate::config::AdamWConfig;

/// AdamW state for one flat f32 buffer (a rank's master shard, or the full model).
#[derive(Debug, Clone, PartialEq)]
pub struct AdamW {
    cfg: AdamWConfig,
    step: u64,
    m: Vec<f32>,
    v: Vec<f32>,
}

impl AdamW {
    /// Fresh state (zero moments) for `len` parameters.
    pub fn new(cfg: AdamWConfig, len: usize) -> Self {
        Self { cfg, step: 0, m: vec![0.0; len], v: vec![0.0; len] }
    }

    /// State restored from a checkpoint: `step` updates done, moments `m` and `v`.
    pub fn from_state(cfg: AdamWConfig, step: u64, m: Vec<f32>, v: Vec<f32>) -> Result<Self, EngineError> {
        if m.len() != v.len() {
            return Err(EngineError::LengthMismatch {
                what: "AdamW second moment",
                expected: m.len(),
                got: v.len(),
            });
        }
        Ok(Self { cfg, step, m, v })
    }

    /// Number of updates applied so far (skipped steps do not count).
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The first moment.
    pub fn m(&self) -> &[f32] {
        &self.m
    }

    /// The second moment.
    pub fn v(&self) -> &[f32] {
        &self.v
    }

    /// The hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }

    /// One update: `params -= lr * (m̂ / (sqrt(v̂) + eps) + wd * params)` with the
    /// gradient `grads * grad_scale` (the clipping factor, 1 when not clipping).
    ///
    /// ```
    /// use zeropp_engine::{config::AdamWConfig, optim::AdamW};
    /// let mut opt = AdamW::new(AdamWConfig { lr: 0.1, weight_decay: 0.0, ..AdamWConfig::default() }, 2);
    /// let mut p = vec![1.0f32, -1.0];
    /// opt.step(&mut p, &[1.0, -1.0], 1.0)?;
    /// assert!((p[0] - 0.9).abs() < 1e-5 && (p[1] + 0.9).abs() < 1e-5);
    /// # Ok::<(), zeropp_engine::EngineError>(())
    /// ```
    pub fn step(&mut self, params: &mut [f32], grads: &[f32], grad_scale: f32) -> Result<(), EngineError> {
        let n = self.m.len();
        if params.len() != n {
            return Err(EngineError::LengthMismatch {
                what: "AdamW parameters",
                expected: n,
                got: params.len(),
            });
        }
        if grads.len() != n {
            return Err(EngineError::LengthMismatch {
                what: "AdamW gradients",
                expected: n,
                got: grads.len(),
            });
        }
        self.step += 1;
        let AdamWConfig { lr, beta1, beta2, eps, weight_decay } = self.cfg;
        let t = self.step as i32;
        let bc1 = (1.0 - f64::from(beta1).powi(t)) as f32;
        let bc2 = (1.0 - f64::from(beta2).powi(t)) as f32;
        let step_size = lr / bc1;
        let bc2_sqrt = bc2.sqrt();
        let decay = 1.0 - lr * weight_decay;
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(self.m.iter_mut()).zip(self.v.iter_mut()) {
            let g = g * grad_scale;
            *m = beta1 * *m + (1.0 - beta1) * g;
            *v = beta2 * *v + (1.0 - beta2) * g * g;
            let denom = v.sqrt() / bc2_sqrt + eps;
            *p = *p * decay - step_size * *m / denom;
        }
        Ok(())
    }
}

/// The clipping factor for a global gradient norm: `min(1, max_norm / (norm + 1e-6))`
/// (DeepSpeed's formula); 1 when clipping is off.
pub fn clip_factor(global_norm: f32, max_norm: Option<f32>) -> f32 {
    match max_norm {
        Some(c) if c > 0.0 => {
            let f = c / (global_norm + 1e-6);
            if f < 1.0 { f } else { 1.0 }
        }
        _ => 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sharded_equals_full() {
        let cfg = AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() };
        let grads: Vec<f32> = (0..10).map(|i| (i as f32 - 4.5) * 0.3).collect();
        let mut full: Vec<f32> = (0..10).map(|i| i as f32 * 0.1).collect();
        let mut shards = full.clone();
        let mut opt = AdamW::new(cfg, 10);
        let mut a = AdamW::new(cfg, 4);
        let mut b = AdamW::new(cfg, 6);
        for _ in 0..3 {
            opt.step(&mut full, &grads, 0.5).unwrap();
            let (lo, hi) = shards.split_at_mut(4);
            a.step(lo, &grads[..4], 0.5).unwrap();
            b.step(hi, &grads[4..], 0.5).unwrap();
        }
        assert_eq!(full, shards);
        assert!(opt.step(&mut full[..3], &grads, 1.0).is_err());
    }

    #[test]
    fn clipping() {
        assert_eq!(clip_factor(0.5, Some(1.0)), 1.0);
        assert!((clip_factor(4.0, Some(1.0)) - 0.25).abs() < 1e-6);
        assert_eq!(clip_factor(4.0, None), 1.0);
    }
}
