//! `zeropp compare`: ZeRO-3, ZeRO++ and each ZeRO++ technique alone on the same
//! workload, seed and link model, side by side.
//!
//! Every ratio is taken against the fair baseline, ZeRO-3 with hierarchical
//! routing (the inter-node hop over the rail, as NCCL and torch HSDP route),
//! with the ratio against ZeRO-3 with flat routing (every rank with every rank)
//! beside it: flat routing sends more bytes across nodes, so a ratio against it
//! alone would flatter ZeRO++.
//!
//! This module runs the variants and keeps their records ([`Comparison`]) and
//! their ratios ([`Comparison::ratios`]); presentation (the markdown table, the
//! SVG plots) is the CLI's.

use zeropp_comm::collectives::Routing;

use crate::RunError;
use crate::train::TrainConfig;
use zeropp_engine::config::{QgzConfig, ZeroConfig};
use zeropp_engine::launch::{Launch, TrainReport};
use zeropp_engine::metrics::{StepRecord, Summary};

/// Name of the baseline variant of [`standard_variants`]: ZeRO-3, hierarchical routing.
pub const BASELINE: &str = "zero3";
/// Name of the flat-routing ZeRO-3 variant of [`standard_variants`], shown beside the baseline.
pub const FLAT_BASELINE: &str = "zero3-flat";

/// One configuration of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    /// Label (`zero3`, `zero3-flat`, `qwz`, `hpz`, `qgz`, `zeropp`, `zeropp-delta`).
    pub name: String,
    /// The ZeRO switches of this variant (the rest of the run is shared).
    pub zero: ZeroConfig,
}

impl Variant {
    /// True for plain ZeRO-3: no ZeRO++ technique on.
    pub fn is_zero3(&self) -> bool {
        self.zero.qwz.is_none()
            && !self.zero.hpz()
            && self.zero.qgz.is_none()
            && self.zero.qwz_delta.is_none()
    }
}

/// The standard set: ZeRO-3 with hierarchical routing (the baseline), ZeRO-3
/// with flat routing, qwZ alone, hpZ alone, qgZ alone, full ZeRO++, and
/// ZeRO++ with SDP4Bit's techniques ([`ZeroConfig::zeropp_delta`]); every
/// variant but `zero3-flat` routes hierarchically. The baseline dtype and the
/// qwZ and qgZ specs come from `base` (the defaults for a technique it has off);
/// qgZ alone keeps `base`'s qgZ options, full ZeRO++ takes its defaults' (and
/// `zeropp-delta` the preset's, with `base`'s qgZ group size when it is a
/// power of two, as its Hadamard rotation needs).
///
/// ```
/// use zeropp_comm::collectives::Routing;
/// use zeropp_run::compare::standard_variants;
/// use zeropp_engine::config::ZeroConfig;
/// let v = standard_variants(&ZeroConfig::zero3(), 4);
/// let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
/// assert_eq!(names, ["zero3", "zero3-flat", "qwz", "hpz", "qgz", "zeropp", "zeropp-delta"]);
/// assert_eq!(v[0].zero.routing, Routing::Hierarchical);
/// assert_eq!(v[1].zero.routing, Routing::Flat);
/// assert!(v[0].is_zero3() && v[1].is_zero3() && !v[5].is_zero3());
/// ```
pub fn standard_variants(base: &ZeroConfig, local_size: usize) -> Vec<Variant> {
    let z3 = ZeroConfig {
        qwz: None,
        hpz_size: 1,
        qgz: None,
        qwz_delta: None,
        routing: Routing::Hierarchical,
        ..*base
    };
    let hpz = local_size.max(1);
    let qwz = base.qwz.unwrap_or_else(ZeroConfig::default_qwz_spec);
    let qgz = base.qgz.unwrap_or_default();
    let qgz_zeropp = ZeroConfig::zeropp(hpz).qgz.map(|d| QgzConfig { spec: qgz.spec, ..d });
    vec![
        Variant { name: BASELINE.into(), zero: z3 },
        Variant { name: FLAT_BASELINE.into(), zero: ZeroConfig { routing: Routing::Flat, ..z3 } },
        Variant { name: "qwz".into(), zero: z3.with_qwz(qwz) },
        Variant { name: "hpz".into(), zero: z3.with_hpz(hpz) },
        Variant { name: "qgz".into(), zero: z3.with_qgz(qgz) },
        // ZeRO++ with its default options (LoCo, 1-D parameters at the baseline precision).
        Variant {
            name: "zeropp".into(),
            zero: ZeroConfig { qwz: Some(qwz), hpz_size: hpz, qgz: qgz_zeropp, ..z3 },
        },
        Variant {
            name: "zeropp-delta".into(),
            zero: ZeroConfig {
                qwz: Some(qwz),
                hpz_size: hpz,
                qgz: Some(QgzConfig::sdp4bit(if qgz.spec.group_size().is_power_of_two() {
                    qgz.spec
                } else {
                    ZeroConfig::default_qgz_spec()
                })),
                qwz_delta: Some(base.qwz_delta.unwrap_or_default()),
                ..z3
            },
        },
    ]
}

/// The result of one variant.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantResult {
    /// The variant.
    pub variant: Variant,
    /// Its run: every step's record and the summary.
    pub report: TrainReport,
}

/// One variant against one reference run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ratios {
    /// Reference mean step time / this variant's (above 1: faster).
    pub speedup: f64,
    /// This variant's inter-node bytes per rank per step / the reference's
    /// (below 1: fewer; 0 when the reference sends none across nodes).
    pub inter_bytes: f64,
}

impl Ratios {
    /// `this` against `reference`.
    pub fn between(this: &Summary, reference: &Summary) -> Self {
        let inter_bytes = if reference.bytes_per_step.inter > 0.0 {
            this.bytes_per_step.inter / reference.bytes_per_step.inter
        } else {
            0.0
        };
        Self { speedup: reference.mean_step_time_s / this.mean_step_time_s.max(1e-12), inter_bytes }
    }
}

/// A variant's ratios against the baseline and, beside them, against flat ZeRO-3.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VariantRatios {
    /// Against [`Comparison::baseline`] (hierarchical ZeRO-3).
    pub baseline: Ratios,
    /// Against [`Comparison::flat_baseline`] (flat ZeRO-3), when it ran.
    pub flat: Option<Ratios>,
}

/// All results, in the order of the variants.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// One per variant, in order.
    pub results: Vec<VariantResult>,
}

/// Runs every variant on `base` (same data, seed, batch, link model).
/// `on_step(variant_index, record)` is called after every step.
///
/// ```
/// use zeropp_run::compare::{Variant, compare};
/// use zeropp_engine::config::ZeroConfig;
/// use zeropp_run::train::TrainConfig;
/// let base = TrainConfig::tiny().with_steps(2);
/// let variants = [
///     Variant { name: "zero3".into(), zero: ZeroConfig::zero3() },
///     Variant { name: "zeropp".into(), zero: ZeroConfig::zeropp(base.run.local_size) },
/// ];
/// let cmp = compare(&base, &variants, &mut |_, _| {})?;
/// assert_eq!(cmp.results.len(), 2);
/// assert_eq!(cmp.baseline().map(|b| b.variant.name.as_str()), Some("zero3"));
/// assert!(cmp.ratios(&cmp.results[1]).baseline.inter_bytes < 0.5);
/// # Ok::<(), zeropp_run::RunError>(())
/// ```
pub fn compare(
    base: &TrainConfig,
    variants: &[Variant],
    on_step: &mut dyn FnMut(usize, &StepRecord),
) -> Result<Comparison, RunError> {
    let mut results = Vec::with_capacity(variants.len());
    let (model, data, info) = base.build()?;
    for (i, v) in variants.iter().enumerate() {
        let mut run = base.run.clone();
        run.engine.zero = v.zero;
        run.metrics = None;
        run.save = None;
        run.resume = None;
        let report =
            Launch::new(&model, &data, &run).describe(info.clone()).on_step(&mut |r| on_step(i, r)).run()?;
        results.push(VariantResult { variant: v.clone(), report });
    }
    Ok(Comparison { results })
}

impl Comparison {
    /// The baseline of every ratio: the first plain ZeRO-3 run with hierarchical
    /// routing, else the first run.
    pub fn baseline(&self) -> Option<&VariantResult> {
        self.results
            .iter()
            .find(|r| r.variant.is_zero3() && r.variant.zero.routing == Routing::Hierarchical)
            .or_else(|| self.results.first())
    }

    /// The first plain ZeRO-3 run with flat routing, if any.
    pub fn flat_baseline(&self) -> Option<&VariantResult> {
        self.results.iter().find(|r| r.variant.is_zero3() && r.variant.zero.routing == Routing::Flat)
    }

    /// `r` against the baseline and against flat ZeRO-3 (ratios of 1 when
    /// there is no baseline, i.e. no results).
    pub fn ratios(&self, r: &VariantResult) -> VariantRatios {
        let this = &r.report.summary;
        let baseline = self
            .baseline()
            .map_or(Ratios { speedup: 1.0, inter_bytes: 1.0 }, |b| Ratios::between(this, &b.report.summary));
        let flat = self.flat_baseline().map(|f| Ratios::between(this, &f.report.summary));
        VariantRatios { baseline, flat }
    }
}
