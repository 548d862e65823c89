//! `zeropp compare`: ZeRO-3, ZeRO++ and each ZeRO++ technique alone on the same
//! workload, seed and link model, side by side, with SVG plots.

use std::path::{Path, PathBuf};

use plotters::prelude::*;

use crate::EngineError;
use crate::config::ZeroConfig;
use crate::metrics::{LinkBytes, StepRecord};
use crate::train::{OP_TAGS, TrainConfig, TrainReport, train_with};

/// One configuration of a comparison.
#[derive(Debug, Clone, PartialEq)]
pub struct Variant {
    /// Label (`zero3`, `qwz`, `hpz`, `qgz`, `zeropp`).
    pub name: String,
    /// The ZeRO switches of this variant (the rest of the run is shared).
    pub zero: ZeroConfig,
}

/// The standard set: ZeRO-3, qwZ alone, hpZ alone, qgZ alone, full ZeRO++.
/// The baseline dtype, group sizes and bits come from `base`.
pub fn standard_variants(base: &ZeroConfig, local_size: usize) -> Vec<Variant> {
    let z3 = ZeroConfig { qwz: false, hpz_size: 1, qgz: false, ..*base };
    let hpz = local_size.max(1);
    vec![
        Variant { name: "zero3".into(), zero: z3 },
        Variant { name: "qwz".into(), zero: ZeroConfig { qwz: true, ..z3 } },
        Variant { name: "hpz".into(), zero: ZeroConfig { hpz_size: hpz, ..z3 } },
        Variant { name: "qgz".into(), zero: ZeroConfig { qgz: true, ..z3 } },
        Variant { name: "zeropp".into(), zero: ZeroConfig { qwz: true, hpz_size: hpz, qgz: true, ..z3 } },
    ]
}

/// The result of one variant.
#[derive(Debug, Clone, PartialEq)]
pub struct VariantResult {
    /// The variant.
    pub variant: Variant,
    /// Its run.
    pub report: TrainReport,
}

/// All results; the first is the baseline of the speedups.
#[derive(Debug, Clone, PartialEq)]
pub struct Comparison {
    /// One per variant, in order.
    pub results: Vec<VariantResult>,
}

/// Runs every variant on `base` (same data, seed, batch, link model).
/// `on_step(variant_index, record)` is called after every step.
pub fn compare(
    base: &TrainConfig,
    variants: &[Variant],
    on_step: &mut dyn FnMut(usize, &StepRecord),
) -> Result<Comparison, EngineError> {
    let mut results = Vec::with_capacity(variants.len());
    for (i, v) in variants.iter().enumerate() {
        let mut cfg = base.clone();
        cfg.engine.zero = v.zero;
        cfg.metrics = None;
        cfg.save = None;
        cfg.resume = None;
        let report = train_with(&cfg, &mut |r| on_step(i, r))?;
        results.push(VariantResult { variant: v.clone(), report });
    }
    Ok(Comparison { results })
}

fn mb(b: f64) -> String {
    format!("{:.3}", b / 1e6)
}

impl Comparison {
    /// The side-by-side table (markdown): final/val loss, step time, bytes per
    /// rank per step by link class, and the ratios to the first variant.
    pub fn table(&self) -> String {
        let mut s = String::from(
            "| variant | final loss | val loss | step time (s) | speedup | inter-node MB/rank/step | intra-node MB/rank/step | inter-node vs first |\n|---|---|---|---|---|---|---|---|\n",
        );
        let base = self.results.first().map(|r| &r.report.summary);
        for r in &self.results {
            let sm = &r.report.summary;
            let speedup = base.map_or(1.0, |b| b.mean_step_time_s / sm.mean_step_time_s.max(1e-12));
            let inter_ratio = base.map_or(1.0, |b| {
                if b.bytes_per_step.inter > 0.0 {
                    sm.bytes_per_step.inter / b.bytes_per_step.inter
                } else {
                    0.0
                }
            });
            s.push_str(&format!(
                "| {} | {:.4} | {} | {:.4} | {:.2}x | {} | {} | {:.3}x |\n",
                r.variant.name,
                sm.final_loss,
                sm.val_loss.map_or_else(|| "-".into(), |v| format!("{v:.4}")),
                sm.mean_step_time_s,
                speedup,
                mb(sm.bytes_per_step.inter),
                mb(sm.bytes_per_step.intra),
                inter_ratio
            ));
        }
        s
    }

    /// Writes `loss.svg` (loss curves) and `bytes.svg` (bytes per rank per step
    /// by operation and link class) into `dir`; returns their paths.
    pub fn write_plots(&self, dir: &Path) -> Result<Vec<PathBuf>, EngineError> {
        std::fs::create_dir_all(dir).map_err(|source| EngineError::Io { path: dir.to_path_buf(), source })?;
        let loss = dir.join("loss.svg");
        let bytes = dir.join("bytes.svg");
        self.plot_loss(&loss)
            .map_err(|e| EngineError::Training(format!("cannot draw {}: {e}", loss.display())))?;
        self.plot_bytes(&bytes)
            .map_err(|e| EngineError::Training(format!("cannot draw {}: {e}", bytes.display())))?;
        Ok(vec![loss, bytes])
    }

    fn plot_loss(&self, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (900, 540)).into_drawing_area();
        root.fill(&WHITE)?;
        let steps = self.results.iter().map(|r| r.report.steps.len()).max().unwrap_or(1).max(2);
        let finite =
            self.results.iter().flat_map(|r| r.report.steps.iter().map(|s| s.loss)).filter(|l| l.is_finite());
        let (lo, hi) = finite.fold((f32::MAX, f32::MIN), |(a, b), l| (a.min(l), b.max(l)));
        let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
        let pad = ((hi - lo) * 0.05).max(1e-3);
        let mut chart = ChartBuilder::on(&root)
            .caption("training loss", ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0usize..steps, (lo - pad)..(hi + pad))?;
        chart.configure_mesh().x_desc("step").y_desc("loss").draw()?;
        for (i, r) in self.results.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(usize, f32)> =
                r.report.steps.iter().filter(|s| s.loss.is_finite()).map(|s| (s.step, s.loss)).collect();
            chart
                .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
                .label(r.variant.name.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
        root.present()?;
        Ok(())
    }

    fn plot_bytes(&self, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::new(path, (1000, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        // One group of bars per variant; one bar per (op, class).
        let series: Vec<(String, bool)> =
            OP_TAGS.iter().flat_map(|op| [(op.to_string(), false), (op.to_string(), true)]).collect();
        let value = |r: &VariantResult, op: &str, inter: bool| {
            let b: LinkBytes = r.report.summary.bytes_by_op.get(op).copied().unwrap_or_default();
            (if inter { b.inter } else { b.intra }) / 1e6
        };
        let max = self
            .results
            .iter()
            .flat_map(|r| series.iter().map(move |(op, c)| value(r, op, *c)))
            .fold(0.0f64, f64::max)
            .max(1e-6);
        let n = self.results.len().max(1);
        let per = series.len() + 1;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "MB sent per rank per step, by operation (solid: inter-node, light: intra-node)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0f64..(n * per) as f64, 0.0..max * 1.1)?;
        let names: Vec<String> = self.results.iter().map(|r| r.variant.name.clone()).collect();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n * 2)
            .x_label_formatter(&|x| {
                let g = (*x as usize) / per;
                if (*x as usize) % per == per / 2 {
                    names.get(g).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("MB")
            .draw()?;
        for (si, (op, inter)) in series.iter().enumerate() {
            let base = Palette99::pick(si / 2).to_rgba();
            let color = if *inter { base.filled() } else { base.mix(0.35).filled() };
            let bars: Vec<Rectangle<(f64, f64)>> = self
                .results
                .iter()
                .enumerate()
                .map(|(g, r)| {
                    let x = (g * per + si) as f64;
                    Rectangle::new([(x, 0.0), (x + 0.9, value(r, op, *inter))], color)
                })
                .collect();
            let label = format!("{op} ({})", if *inter { "inter" } else { "intra" });
            chart
                .draw_series(bars)?
                .label(label)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
        root.present()?;
        Ok(())
    }
}
