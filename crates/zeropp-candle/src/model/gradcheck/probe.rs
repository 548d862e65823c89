//! The check's small helpers: seeded noise and normal draws, the description
//! of a weight's zero-gradient elements, a stage's [`Trial`] and what the
//! backward said about a weight ([`Seen`]).

use candle_core::{DType, Tensor};

use crate::error::Result;
use crate::params::uniform;

/// `n` values uniform in `[-scale, scale)` from stream `key`.
pub(super) fn noise(key: u64, n: usize, scale: f64) -> impl Iterator<Item = f32> {
    (0..n as u64).map(move |i| ((2.0 * uniform(key, i) - 1.0) * scale) as f32)
}

/// `n` standard normal values (f32) from stream `key`.
pub(super) fn normals(key: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let u1 = uniform(key, 2 * i).max(f64::MIN_POSITIVE);
            let u2 = uniform(key, 2 * i + 1);
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect()
}

/// The zero elements of a parameter of shape `shape`, as ranges (rows where
/// a range covers whole rows).
pub(super) fn describe(zeros: &[usize], shape: &[usize]) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &i in zeros {
        match runs.last_mut() {
            Some((_, end)) if *end == i => *end += 1,
            _ => runs.push((i, i + 1)),
        }
    }
    let row = if shape.len() >= 2 { shape[1..].iter().product::<usize>() } else { 0 };
    let mut parts: Vec<String> = runs
        .iter()
        .take(4)
        .map(|&(a, b)| {
            if row > 0 && a % row == 0 && b % row == 0 {
                format!("rows {}..{}", a / row, b / row)
            } else {
                format!("elements {a}..{b}")
            }
        })
        .collect();
    if runs.len() > 4 {
        parts.push(format!("{} more ranges", runs.len() - 4));
    }
    let total: usize = shape.iter().product();
    format!("{} of {total} elements ({})", zeros.len(), parts.join(", "))
}

/// A stage's trial inputs (chunks: token ids for the first stage, one f32
/// activation for a later one) and the mode it is checked in.
#[derive(Clone)]
pub(super) struct Trial {
    pub(super) inputs: Vec<Tensor>,
    pub(super) train: bool,
}

/// What the backward said about one weight (summed over the chunks and, for a
/// tied weight, over its uses).
#[derive(Debug, Clone)]
pub(super) struct Seen {
    /// Elements whose gradient is exactly zero in every chunk and use.
    pub(super) zero: Vec<bool>,
    /// `g · u` (f64 sum of the f32 gradient along the direction).
    pub(super) dot: f64,
    /// `Σ (g_j u_j)²`: `dot`'s rounding, each term rounded independently,
    /// is a few roundoffs of its square root.
    pub(super) sq: f64,
}

impl Seen {
    pub(super) fn new(n: usize) -> Self {
        Self { zero: vec![true; n], dot: 0.0, sq: 0.0 }
    }

    pub(super) fn add(&mut self, g: &Tensor, uv: &[f32]) -> Result<()> {
        let gv = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
        for ((z, &gj), &uj) in self.zero.iter_mut().zip(&gv).zip(uv) {
            *z &= gj == 0.0;
            let p = f64::from(gj) * f64::from(uj);
            self.dot += p;
            self.sq += p * p;
        }
        Ok(())
    }
}
