//! The planner's hardware: GPU presets ([`GpuSpec`]), the cluster
//! ([`Cluster`]) and the bandwidth notation of the flags (`100Gbit/s`,
//! `300GB/s`).

use crate::{Result, RunError};

/// Bytes each quantized element moves through HBM in a quantization kernel
/// pass: read at one width, written at the other (2 + 1 for 16-bit and INT8).
pub(super) const KERNEL_BYTES_PER_ELEMENT: f64 = 3.0;

/// One GPU model's figures: peak dense 16-bit tensor throughput and memory
/// bandwidth, from the vendor's datasheet.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuSpec {
    /// The preset's name (`v100`, `a100`, `h100`, `h200`), or `custom`.
    pub name: String,
    /// Peak dense fp16/bf16 tensor-core FLOP/s.
    pub peak_flops: f64,
    /// Memory (HBM) bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Memory per GPU, bytes (0 when unknown).
    pub memory_bytes: f64,
    /// Elements per second one quantization kernel pass processes (a
    /// quantize or a dequantize of one element): by default the HBM bound,
    /// `hbm / 3` (2 bytes read and 1 written, or the reverse); `kernel=RATE`
    /// gives a measured rate instead (a CPU's, in `cargo xtask bench plan`).
    pub kernel_elements_per_s: f64,
    /// Streaming multiprocessors: the GEMM model's wave size (0 for a custom
    /// GPU: no tile or wave quantization).
    pub sms: usize,
}

impl GpuSpec {
    /// The presets, from NVIDIA's datasheets (dense 16-bit tensor peak, HBM
    /// bandwidth, memory): V100 SXM 125 TFLOP/s, 900 GB/s, 32 GB; A100 SXM
    /// 80GB 312 TFLOP/s, 2039 GB/s; H100 SXM 989 TFLOP/s, 3350 GB/s, 80 GB;
    /// H200 SXM 989 TFLOP/s, 4800 GB/s, 141 GB; 80, 108, 132 and 132 SMs.
    ///
    /// ```
    /// use zeropp_run::plan::GpuSpec;
    /// let v100 = GpuSpec::preset("V100").ok_or("no preset")?;
    /// assert_eq!(v100.peak_flops, 125e12);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn presets() -> [Self; 4] {
        let g = |name: &str, tflops: f64, hbm_gbs: f64, mem_gb: f64, sms: usize| Self {
            name: name.into(),
            peak_flops: tflops * 1e12,
            hbm_bytes_per_s: hbm_gbs * 1e9,
            memory_bytes: mem_gb * 1e9,
            kernel_elements_per_s: hbm_gbs * 1e9 / KERNEL_BYTES_PER_ELEMENT,
            sms,
        };
        [
            g("v100", 125.0, 900.0, 32.0, 80),
            g("a100", 312.0, 2039.0, 80.0, 108),
            g("h100", 989.0, 3350.0, 80.0, 132),
            g("h200", 989.0, 4800.0, 141.0, 132),
        ]
    }

    /// The preset called `name`, case-insensitive.
    pub fn preset(name: &str) -> Option<Self> {
        Self::presets().into_iter().find(|g| g.name.eq_ignore_ascii_case(name))
    }

    /// The GPU's own NVLink bandwidth per direction, bytes/s: the intra-node
    /// rate of a plan that names no other. From NVIDIA's datasheets (the
    /// total of both directions halved): V100 SXM2 150 GB/s (300 GB/s, six
    /// NVLink 2 links), A100 SXM 300 GB/s (600 GB/s), H100 and H200 SXM
    /// 450 GB/s (900 GB/s). `None` for a custom GPU; a preset with figures
    /// replaced keeps its preset's.
    ///
    /// ```
    /// use zeropp_run::plan::GpuSpec;
    /// assert_eq!(GpuSpec::parse("h100,kernel=1e11")?.nvlink_bytes_per_s(), Some(450e9));
    /// assert_eq!(GpuSpec::parse("tflops=0.02")?.nvlink_bytes_per_s(), None);
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn nvlink_bytes_per_s(&self) -> Option<f64> {
        let preset = self.name.split(',').next().unwrap_or_default().trim().to_ascii_lowercase();
        match preset.as_str() {
            "v100" => Some(150e9),
            "a100" => Some(300e9),
            "h100" | "h200" => Some(450e9),
            _ => None,
        }
    }

    /// `--gpu`'s value: a preset name, `tflops=T[,hbm=B][,kernel=K]`, or a
    /// preset with any of those replaced (`h100,kernel=1e11`). B is a
    /// bandwidth such as `2TB/s` (the H100's 3350 GB/s when neither a preset
    /// nor `hbm` gives one); K the quantization kernels' elements per second
    /// (`hbm / 3` when absent).
    ///
    /// ```
    /// use zeropp_run::plan::GpuSpec;
    /// let cpu = GpuSpec::parse("tflops=0.02,kernel=3e8")?;
    /// assert_eq!((cpu.peak_flops, cpu.kernel_elements_per_s), (0.02e12, 3e8));
    /// let g = GpuSpec::parse("tflops=125,hbm=900GB/s")?;
    /// assert_eq!(g.kernel_elements_per_s, 300e9);
    /// let h = GpuSpec::parse("h100,kernel=1e11")?;
    /// assert_eq!((h.peak_flops, h.kernel_elements_per_s), (989e12, 1e11));
    /// # Ok::<(), zeropp_run::RunError>(())
    /// ```
    pub fn parse(s: &str) -> Result<Self> {
        let bad = || {
            RunError::InvalidConfig(format!(
                "--gpu `{s}`: expected one of v100, a100, h100, h200, or tflops=T[,hbm=BANDWIDTH][,kernel=ELEMENTS_PER_S], \
                 or a preset followed by any of those (h100,kernel=1e11)"
            ))
        };
        let mut parts = s.split(',').peekable();
        let mut g = match parts.peek().and_then(|first| Self::preset(first.trim())) {
            Some(preset) => {
                parts.next();
                preset
            }
            None => Self {
                name: "custom".into(),
                peak_flops: 0.0,
                hbm_bytes_per_s: 3350e9,
                memory_bytes: 0.0,
                kernel_elements_per_s: 0.0,
                sms: 0,
            },
        };
        let mut kernel = None;
        let mut hbm = false;
        if parts.peek().is_some() && g.name != "custom" {
            // A preset with figures replaced is named as asked.
            g.name = s.trim().to_string();
        }
        for part in parts {
            match part.trim().split_once('=') {
                Some(("tflops", v)) => g.peak_flops = positive(v, "--gpu tflops")? * 1e12,
                Some(("hbm", v)) => {
                    g.hbm_bytes_per_s = parse_bandwidth(v)?;
                    hbm = true;
                }
                Some(("kernel", v)) => kernel = Some(positive(v, "--gpu kernel")?),
                _ => return Err(bad()),
            }
        }
        if g.peak_flops == 0.0 {
            return Err(RunError::InvalidConfig(format!("--gpu `{s}`: tflops=T is required")));
        }
        match kernel {
            Some(k) => g.kernel_elements_per_s = k,
            // A preset keeps its own bound unless its HBM was replaced.
            None if hbm || g.kernel_elements_per_s == 0.0 => {
                g.kernel_elements_per_s = g.hbm_bytes_per_s / KERNEL_BYTES_PER_ELEMENT;
            }
            None => {}
        }
        Ok(g)
    }
}

/// The cluster: nodes of GPUs, the links between and inside them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cluster {
    /// Nodes.
    pub nodes: usize,
    /// GPUs per node.
    pub gpus_per_node: usize,
    /// Inter-node bandwidth **per node** (all its NICs together), bytes/s, each way.
    pub inter_bytes_per_s: f64,
    /// Intra-node bandwidth **per GPU** (NVLink / NVSwitch), bytes/s, each way.
    pub intra_bytes_per_s: f64,
    /// One collective call's latency, seconds (added once per call).
    pub latency_s: f64,
}

impl Cluster {
    /// GPUs in the cluster.
    pub fn world(&self) -> usize {
        self.nodes * self.gpus_per_node
    }
}

fn positive(v: &str, what: &str) -> Result<f64> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(RunError::InvalidConfig(format!("{what}: `{v}` is not a positive number"))),
    }
}

/// A bandwidth as the flags write it, in bytes/s: a number, a decimal prefix
/// (`k`, `M`, `G`, `T`) and a unit, bits (`bit/s`, `b/s`, `bps`) or bytes
/// (`B/s`, `Bps`). `100Gbit/s` = `100Gbps` = 12.5e9, `300GB/s` = 300e9.
///
/// ```
/// use zeropp_run::plan::parse_bandwidth;
/// assert_eq!(parse_bandwidth("100Gbit/s")?, 12.5e9);
/// assert_eq!(parse_bandwidth("300GB/s")?, 300e9);
/// assert!(parse_bandwidth("300G").is_err()); // bits or bytes?
/// # Ok::<(), zeropp_run::RunError>(())
/// ```
pub fn parse_bandwidth(s: &str) -> Result<f64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == '-' || c == '+'));
    // `e` is also a digit of `1e9`; a unit never starts with `e`.
    let (num, unit) = t.split_at(split.unwrap_or(t.len()));
    let unit = unit.trim_start();
    let bad = || {
        RunError::InvalidConfig(format!(
            "bandwidth `{s}`: expected a number and a unit such as 100Gbit/s, 100Gbps, 300GB/s or 50Mbit/s"
        ))
    };
    let x = num.parse::<f64>().map_err(|_| bad())?;
    let (scale, rest) = match unit.chars().next() {
        Some('k') => (1e3, &unit[1..]),
        Some('M') => (1e6, &unit[1..]),
        Some('G') => (1e9, &unit[1..]),
        Some('T') => (1e12, &unit[1..]),
        _ => (1.0, unit),
    };
    let per_byte = match rest {
        "bit/s" | "b/s" | "bps" => 1.0 / 8.0,
        "B/s" | "Bps" => 1.0,
        _ => return Err(bad()),
    };
    let v = x * scale * per_byte;
    if v.is_finite() && v > 0.0 { Ok(v) } else { Err(bad()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidths_read_bits_and_bytes() {
        assert_eq!(parse_bandwidth("400Gbps").ok(), Some(50e9));
        assert_eq!(parse_bandwidth("10Mbit/s").ok(), Some(1.25e6));
        assert_eq!(parse_bandwidth("1.5TB/s").ok(), Some(1.5e12));
        assert_eq!(parse_bandwidth("12.5e9B/s").ok(), Some(12.5e9));
        for bad in ["", "fast", "100", "100Gb", "-5GB/s", "0GB/s", "100 GB/s/s"] {
            assert!(parse_bandwidth(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn gpus_by_name_or_figures() {
        assert_eq!(GpuSpec::parse("H200").map(|g| g.peak_flops).ok(), Some(989e12));
        let c = GpuSpec::parse("tflops=125,hbm=900GB/s");
        assert_eq!(c.as_ref().map(|g| (g.peak_flops, g.hbm_bytes_per_s)).ok(), Some((125e12, 900e9)));
        assert!(GpuSpec::parse("b200").is_err());
        assert!(GpuSpec::parse("hbm=1TB/s").is_err());
        assert!(GpuSpec::parse("tflops=1,kernel=0").is_err());
        assert!(GpuSpec::parse("tflops=1,kernel=fast").is_err());
        // A preset with figures replaced: the HBM bound follows a new hbm.
        let h = GpuSpec::parse("h100,hbm=1TB/s").ok();
        assert_eq!(h.as_ref().map(|g| (g.peak_flops, g.kernel_elements_per_s)), Some((989e12, 1e12 / 3.0)));
        assert_eq!(h.map(|g| g.name), Some("h100,hbm=1TB/s".to_string()));
        assert_eq!(GpuSpec::parse("a100").map(|g| g.kernel_elements_per_s).ok(), Some(2039e9 / 3.0));
        assert!(GpuSpec::parse("kernel=1e9").is_err());
        assert!(GpuSpec::parse("h100,b200").is_err());
    }
}
