//! The planner's compute model ([`Compute`]): a step's GEMMs ([`Gemm`]),
//! each at the rate its shape gets on the device ([`Compute::Shapes`], the
//! default); or every FLOP at one rate ([`Compute::Flat`]).
//!
//! A GEMM of `m × n` outputs over an inner dimension `k` (16-bit operands)
//! takes the longer of its math and its memory traffic, plus one launch:
//!
//! - **math**: cuBLAS covers the output with tiles of one size and runs them
//!   in waves of one tile per SM, so a GEMM computes
//!   `ceil(tiles / SMs) · SMs` whole tiles (tile and wave quantization,
//!   NVIDIA's "Matrix Multiplication Background User's Guide", ch. 3), each
//!   `2 · tile_m · tile_n · k` FLOPs at `peak × efficiency`; the planner
//!   takes the fastest of the guide's tensor-core tiles ([`TILES`]), as
//!   cuBLAS's heuristics pick a tile per shape. Every tile runs at the same
//!   rate per SM here, so the model picks the tile that pads least or fills
//!   the waves best, often 64×128; that larger tiles reuse more data per SM
//!   (the guide's reason they are the most efficient) is not modelled;
//! - **memory**: `2·(m·k + k·n + m·n)` bytes at the HBM bandwidth (the
//!   roofline's other side: skinny GEMMs are bandwidth-bound);
//! - **launch**: [`LAUNCH_S`], a floor under any GEMM: the whole run time of
//!   the smallest GEMM DeepBench timed on a V100 (its math included), applied
//!   to every GPU.
//!
//! A batched GEMM (attention's `B · heads` products) is one launch whose
//! tiles share the waves. The backward of `C = A·B` is two GEMMs, `dA = dC·Bᵀ`
//! (`m × k` over `n`) and `dB = Aᵀ·dC` (`k × n` over `m`): the same FLOPs at
//! other shapes.
//!
//! The efficiency is what a tile achieves of the peak. At
//! [`V100_GEMM_EFFICIENCY`], DeepBench's measured V100 GEMMs, the model is a
//! GEMM's own rate (14 of DeepBench's shapes within 5.9% on average, the
//! worst 16%: the tests hold them to 7% and 20%), an upper bound on a training step, whose
//! normalisations, activations, optimizer and framework run between the
//! GEMMs; at the planner's default 0.5 (Megatron-LM's end-to-end fraction,
//! [`super::Efficiency::default`]) those costs are folded into every GEMM's
//! rate, and the shapes still set what tiles and waves waste.

use super::GpuSpec;

/// cuBLAS's tensor-core tile shapes the model chooses from (output rows ×
/// columns): the guide's typical tiles, 256×128 and 128×256 the most
/// efficient, down to 64×128 (NVIDIA, "Matrix Multiplication Background
/// User's Guide", §2.3).
pub const TILES: [(f64, f64); 5] =
    [(256.0, 128.0), (128.0, 256.0), (128.0, 128.0), (128.0, 64.0), (64.0, 128.0)];

/// The median rate of DeepBench's fp16 GEMMs on a V100 with every dimension
/// at least 1024 (58 shapes, 89-112 TFLOP/s, median 100.6) over its
/// 125 TFLOP/s peak: Baidu's DeepBench, `results/train/DeepBench_NV_V100.xlsx`
/// (CUDA 10.1, DGX-1). A GEMM alone's efficiency, not a training step's.
pub const V100_GEMM_EFFICIENCY: f64 = 0.805;

/// How the planner turns FLOPs into seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Compute {
    /// Each GEMM at the rate its shape gets on the GPU (the module docs).
    #[default]
    Shapes,
    /// Every FLOP at `peak × efficiency` (a rate measured on the whole step,
    /// as the namespace cluster's benches give it).
    Flat,
}

impl Compute {
    /// `--compute`'s value: `shapes` or `flat`.
    ///
    /// ```
    /// use zeropp_run::plan::Compute;
    /// assert_eq!(Compute::parse("flat")?, Compute::Flat);
    /// assert!(Compute::parse("fast").is_err());
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn parse(s: &str) -> crate::Result<Self> {
        match s.trim() {
            "shapes" => Ok(Self::Shapes),
            "flat" => Ok(Self::Flat),
            _ => Err(crate::RunError::InvalidConfig(format!(
                "--compute `{s}`: expected shapes (each GEMM at the rate its shape gets) or flat (every FLOP at one rate)"
            ))),
        }
    }
}

/// A floor under every GEMM launch, seconds: the whole run time of the
/// shortest fp16 GEMM Baidu's DeepBench times on a V100
/// (`results/train/DeepBench_NV_V100.xlsx`, 1024×16×512 in 8 µs, its math
/// included), taken for every GPU.
pub const LAUNCH_S: f64 = 8e-6;

/// `count` launches of `batch` GEMMs each of `rows × cols` outputs over an
/// inner dimension `inner`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Gemm {
    /// Output rows (the tokens, for a projection's forward).
    pub rows: f64,
    /// Output columns.
    pub cols: f64,
    /// The inner (reduced) dimension.
    pub inner: f64,
    /// GEMMs in one batched launch.
    pub batch: f64,
    /// Launches.
    pub count: f64,
}

impl Gemm {
    /// `count` single GEMMs of `rows × cols` over `inner`.
    pub fn new(rows: usize, cols: usize, inner: usize, count: usize) -> Self {
        Self::batched(rows, cols, inner, 1, count)
    }

    /// `count` launches of `batch` GEMMs each.
    pub fn batched(rows: usize, cols: usize, inner: usize, batch: usize, count: usize) -> Self {
        Self {
            rows: rows as f64,
            cols: cols as f64,
            inner: inner as f64,
            batch: batch as f64,
            count: count as f64,
        }
    }

    /// FLOPs: 2 per multiply-add.
    pub fn flops(&self) -> f64 {
        2.0 * self.rows * self.cols * self.inner * self.batch * self.count
    }

    /// The two GEMMs of its backward: the left operand's gradient (`rows ×
    /// inner` over `cols`) and the right one's (`inner × cols` over `rows`).
    pub fn backward(&self) -> [Gemm; 2] {
        [
            Gemm { rows: self.rows, cols: self.inner, inner: self.cols, ..*self },
            Gemm { rows: self.inner, cols: self.cols, inner: self.rows, ..*self },
        ]
    }

    /// Seconds on `gpu`, each tile at `efficiency` of its peak (see the
    /// [module docs](self)). A GPU without an SM count (a custom `--gpu
    /// tflops=T`) has no tile or wave quantization.
    ///
    /// ```
    /// use zeropp_run::plan::{Gemm, GpuSpec, V100_GEMM_EFFICIENCY};
    /// let v100 = GpuSpec::preset("v100").ok_or("preset")?;
    /// // A 1024 x 24000 x 2048 fp16 GEMM: DeepBench times it at 102 TFLOP/s on a V100.
    /// let g = Gemm::new(1024, 24000, 2048, 1);
    /// let tflops = g.flops() / g.seconds(&v100, V100_GEMM_EFFICIENCY) / 1e12;
    /// assert!((tflops / 102.1 - 1.0).abs() < 0.05, "{tflops}");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn seconds(&self, gpu: &GpuSpec, efficiency: f64) -> f64 {
        let rate = gpu.peak_flops * efficiency;
        let (m, n, k) = (self.rows, self.cols, self.inner);
        let math = if gpu.sms == 0 {
            self.batch * 2.0 * m * n * k / rate
        } else {
            let sms = gpu.sms as f64;
            TILES
                .iter()
                .map(|&(tm, tn)| {
                    let tiles = self.batch * (m / tm).ceil() * (n / tn).ceil();
                    (tiles / sms).ceil() * sms * 2.0 * tm * tn * k / rate
                })
                .fold(f64::INFINITY, f64::min)
        };
        let memory = self.batch * 2.0 * (m * k + k * n + m * n) / gpu.hbm_bytes_per_s;
        self.count * (math.max(memory) + LAUNCH_S)
    }
}

/// One micro-batch's forward GEMMs: the blocks' (recomputed under activation
/// checkpointing) and the head's.
#[derive(Debug, Clone, PartialEq)]
pub struct Work {
    /// The blocks' GEMMs, every layer.
    pub blocks: Vec<Gemm>,
    /// The head's (and anything else outside the blocks).
    pub head: Vec<Gemm>,
}

impl Work {
    /// FLOPs, split (forward, the rest: backward twice the forward, and the
    /// blocks' forward again under checkpointing).
    pub fn flops(&self, checkpointing: bool) -> (f64, f64) {
        let sum = |gs: &[Gemm]| gs.iter().map(Gemm::flops).sum::<f64>();
        let (blocks, head) = (sum(&self.blocks), sum(&self.head));
        (blocks + head, 2.0 * (blocks + head) + if checkpointing { blocks } else { 0.0 })
    }

    /// Seconds on `gpu` at `efficiency`, split as [`Work::flops`].
    pub fn seconds(
        &self,
        gpu: &GpuSpec,
        compute: Compute,
        efficiency: f64,
        checkpointing: bool,
    ) -> (f64, f64) {
        if compute == Compute::Flat {
            let (f, rest) = self.flops(checkpointing);
            let rate = gpu.peak_flops * efficiency;
            return (f / rate, rest / rate);
        }
        let forward = |gs: &[Gemm]| gs.iter().map(|g| g.seconds(gpu, efficiency)).sum::<f64>();
        let backward =
            |gs: &[Gemm]| gs.iter().flat_map(Gemm::backward).map(|g| g.seconds(gpu, efficiency)).sum::<f64>();
        let blocks = forward(&self.blocks);
        let bwd = backward(&self.blocks) + backward(&self.head);
        (blocks + forward(&self.head), bwd + if checkpointing { blocks } else { 0.0 })
    }
}

/// What the planner says of its compute model, with each constant's source.
pub fn describe(gpu: &GpuSpec, compute: Compute, efficiency: f64) -> String {
    match compute {
        Compute::Flat => {
            format!("flat, every FLOP at {efficiency} of the {:.3e} FLOP/s peak", gpu.peak_flops)
        }
        Compute::Shapes if gpu.sms == 0 => format!(
            "GEMM shapes, each at {efficiency} of {:.3e} FLOP/s or {:.0} GB/s (a custom GPU: no tiles), \
             {} µs a launch (DeepBench)",
            gpu.peak_flops,
            gpu.hbm_bytes_per_s / 1e9,
            LAUNCH_S * 1e6
        ),
        Compute::Shapes => format!(
            "GEMM shapes, each tile at {efficiency} of {:.0} TFLOP/s on {} SMs (cuBLAS's tiles, NVIDIA's GEMM \
             guide) or {:.0} GB/s, {} µs a launch (DeepBench)",
            gpu.peak_flops / 1e12,
            gpu.sms,
            gpu.hbm_bytes_per_s / 1e9,
            LAUNCH_S * 1e6
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v100() -> GpuSpec {
        GpuSpec::preset("v100").unwrap_or_else(|| unreachable!("v100 is a preset"))
    }

    /// Rows of DeepBench's fp16 training GEMMs on a V100 (M, N, K, TFLOP/s;
    /// `results/train/DeepBench_NV_V100.xlsx`, "Results - FP16 ip, Mixed
    /// math", the N/N rows with every dimension at least 128): the model
    /// predicts each within 20% and the set within 7% on average (16% and 5.9%
    /// measured). Only the median of the large ones set a constant (the GEMM
    /// efficiency).
    const DEEPBENCH_V100: [(usize, usize, usize, f64); 14] = [
        (1760, 7000, 1760, 89.4),
        (2048, 7000, 2048, 98.0),
        (4096, 7000, 4096, 112.3),
        (4096, 128, 4096, 64.1),
        (5124, 9124, 2048, 96.1),
        (7680, 128, 2560, 68.0),
        (3072, 128, 1024, 33.6),
        (6144, 24000, 2048, 106.2),
        (3072, 24000, 1024, 93.8),
        (512, 24000, 2048, 100.7),
        (1024, 24000, 1530, 96.2),
        (512, 48000, 1530, 94.7),
        (1024, 48000, 2816, 107.7),
        (1024, 700, 512, 40.8),
    ];

    #[test]
    fn gemm_rates_follow_deepbench_on_a_v100() {
        let g = v100();
        let mut sum = 0.0;
        for (m, n, k, tflops) in DEEPBENCH_V100 {
            let gemm = Gemm::new(m, n, k, 1);
            let err = gemm.flops() / gemm.seconds(&g, V100_GEMM_EFFICIENCY) / 1e12 / tflops - 1.0;
            assert!(err.abs() < 0.20, "{m}x{n}x{k}: {err:+.2}");
            sum += err.abs();
        }
        let mae = sum / DEEPBENCH_V100.len() as f64;
        assert!(mae < 0.07, "mean error {mae:.3}");
    }

    #[test]
    fn padded_tiles_and_partial_waves_cost_whole() {
        // One SM and an HBM that never binds: a tile's rows past 128 pay for a
        // 64-row tile more (the cheapest cover of 129 rows is 3 x 64).
        let mut g = v100();
        (g.sms, g.hbm_bytes_per_s) = (1, 1e18);
        let rate = |gpu: &GpuSpec, m: usize, n: usize| {
            let x = Gemm::new(m, n, 1 << 22, 1);
            x.flops() / x.seconds(gpu, 1.0)
        };
        let r = rate(&g, 129, 128) / rate(&g, 128, 128);
        assert!((r - 129.0 / 192.0).abs() < 0.01, "{r}");
        // 192 x 192 outputs take six 64 x 128 tiles, 192² of 6·64·128 used.
        let r = rate(&g, 192, 192) / rate(&g, 128, 128);
        assert!((r - 0.75).abs() < 0.01, "{r}");
        // 80 SMs: 80 tiles of 256 x 128 fill one wave; one column of tiles more
        // (8 tiles) starts a second wave, which 64 x 128 tiles fill better.
        g.sms = 80;
        let r = rate(&g, 2048, 1408) / rate(&g, 2048, 1280);
        assert!(r < 0.97 && r > 0.85, "{r}");
    }

    #[test]
    fn the_backward_is_twice_the_forward_in_flops() {
        let x = Gemm::batched(512, 128, 64, 96, 40);
        let back: f64 = x.backward().iter().map(Gemm::flops).sum();
        assert_eq!(back, 2.0 * x.flops());
        // dA is m x k over n, dB k x n over m.
        let [da, db] = x.backward();
        assert_eq!(
            (da.rows, da.cols, da.inner, db.rows, db.cols, db.inner),
            (512.0, 64.0, 128.0, 64.0, 128.0, 512.0)
        );
        let w = Work { blocks: vec![x], head: vec![Gemm::new(1024, 50257, 6144, 1)] };
        let (f, rest) = w.flops(true);
        assert_eq!(rest, 2.0 * f + x.flops());
        // Flat: the FLOPs at one rate; the shapes' model is slower than that rate.
        let g = v100();
        let (sf, sr) = w.seconds(&g, Compute::Flat, 0.5, true);
        assert!((sf * g.peak_flops * 0.5 / f - 1.0).abs() < 1e-12);
        assert!((sr * g.peak_flops * 0.5 / rest - 1.0).abs() < 1e-12);
        let (gf, gr) = w.seconds(&g, Compute::Shapes, 0.5, true);
        assert!(gf > sf && gr > sr);
    }
}
