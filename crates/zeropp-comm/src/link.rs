//! The optional link model of the thread backend: bandwidth and latency per link class.
//!
//! Every rank has one egress port per [`LinkClass`]. A message of `b` payload bytes
//! to a peer of class `c` occupies the sender's port `c` for
//! `latency_c + b / bandwidth_c`, starting when the port is free (so consecutive
//! sends on one port queue behind each other), and is delivered no earlier than the
//! instant that transfer finishes. The receiver blocks (sleeps) until that instant,
//! so wall-clock step times reflect the modelled cluster. Self-sends are free.
//!
//! The model is parsed from the CLI's `--link` syntax:
//!
//! ```
//! use zeropp_comm::LinkModel;
//! let m: LinkModel = "intra=100GB/s,inter=12.5GB/s,latency=5us".parse()?;
//! assert_eq!(m.inter.bandwidth_bytes_per_s, 12.5e9);
//! assert_eq!(m.intra.latency, std::time::Duration::from_micros(5));
//! let m: LinkModel = "intra=800Gbit/s,inter=100Gbit/s,inter_latency=10us".parse()?;
//! assert_eq!(m.intra.bandwidth_bytes_per_s, 100e9);
//! assert_eq!(m.intra.latency, std::time::Duration::ZERO);
//! # Ok::<(), zeropp_comm::CommError>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::{CommError, LinkClass};

/// TCP payload per byte of Ethernet frame at a 1500-byte MTU with TCP timestamps:
/// 1448 of 1514 (`inter_framing=tcp`).
pub const TCP_PAYLOAD_PER_FRAME: f64 = 1448.0 / 1514.0;

/// One link class: sustained bandwidth and per-message latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Sustained bandwidth in bytes per second (must be finite and > 0).
    pub bandwidth_bytes_per_s: f64,
    /// Fixed cost of every message.
    pub latency: Duration,
}

impl Link {
    /// The time a message of `bytes` payload occupies a port: `latency + bytes / bandwidth`.
    pub fn transfer_time(&self, bytes: usize) -> Duration {
        self.latency + Duration::from_secs_f64(bytes as f64 / self.bandwidth_bytes_per_s)
    }
}

/// Bandwidth and latency of intra-node and inter-node links.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LinkModel {
    /// Links between ranks of one node.
    pub intra: Link,
    /// Links between ranks of different nodes.
    pub inter: Link,
}

impl LinkModel {
    /// The link of one class.
    pub fn link(&self, class: LinkClass) -> &Link {
        class.pick(&self.intra, &self.inter)
    }

    /// Parses `intra=<bw>,inter=<bw>[,latency=<t>][,intra_latency=<t>][,inter_latency=<t>]`
    /// `[,inter_share=<n>][,inter_framing=tcp]`.
    ///
    /// Bandwidth units: `B/s`, `KB/s`, `MB/s`, `GB/s`, `TB/s` (powers of 1000),
    /// `KiB/s`, `MiB/s`, `GiB/s` (powers of 1024), `bit/s`, `Kbit/s`, `Mbit/s`,
    /// `Gbit/s`, `Tbit/s` (also spelled `Gb/s` or `Gbps`). Latency units: `ns`, `us`
    /// (or `µs`), `ms`, `s`; a bare `0` is allowed. `latency` sets both classes.
    ///
    /// Two corrections for a real network, measured on `cargo xtask cluster`:
    /// - `inter_share=n`: `inter` is one node uplink shared by the node's `n` ranks, which
    ///   all send at once in every collective, so each rank's inter-node port gets
    ///   `inter / n` (without it, every rank has a port of its own at the full rate);
    /// - `inter_framing=tcp`: `inter` is a wire rate counted in Ethernet frames, of which
    ///   TCP payload is 1448 of every 1514 bytes (0.956).
    ///
    /// ```
    /// use zeropp_comm::LinkModel;
    /// let m: LinkModel = "intra=10GB/s,inter=100Mbit/s,inter_share=2,inter_framing=tcp".parse()?;
    /// assert!((m.inter.bandwidth_bytes_per_s - 12.5e6 / 2.0 * 1448.0 / 1514.0).abs() < 1e-6);
    /// # Ok::<(), zeropp_comm::CommError>(())
    /// ```
    pub fn parse(s: &str) -> Result<Self, CommError> {
        let mut intra = None;
        let mut inter = None;
        let mut lat = [None, None];
        let mut inter_factor = 1.0;
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| CommError::InvalidConfig(format!("link model: `{part}` is not key=value")))?;
            match key.trim() {
                "intra" => intra = Some(parse_bandwidth(value.trim())?),
                "inter" => inter = Some(parse_bandwidth(value.trim())?),
                "latency" => {
                    let l = parse_latency(value.trim())?;
                    lat = [Some(l), Some(l)];
                }
                "intra_latency" => lat[0] = Some(parse_latency(value.trim())?),
                "inter_latency" => lat[1] = Some(parse_latency(value.trim())?),
                "inter_share" => {
                    let n: usize = value.trim().parse().ok().filter(|&n| n >= 1).ok_or_else(|| {
                        CommError::InvalidConfig(format!(
                            "link model: inter_share `{value}` must be a whole number >= 1"
                        ))
                    })?;
                    inter_factor /= n as f64;
                }
                "inter_framing" => match value.trim() {
                    "tcp" => inter_factor *= TCP_PAYLOAD_PER_FRAME,
                    "none" => {}
                    other => {
                        return Err(CommError::InvalidConfig(format!(
                            "link model: inter_framing `{other}` (expected tcp or none)"
                        )));
                    }
                },
                other => {
                    return Err(CommError::InvalidConfig(format!(
                        "link model: unknown key `{other}` (expected intra, inter, latency, intra_latency, \
                         inter_latency, inter_share, inter_framing)"
                    )));
                }
            }
        }
        let missing =
            |k: &str| CommError::InvalidConfig(format!("link model: `{k}=<bandwidth>` is required"));
        Ok(Self {
            intra: Link {
                bandwidth_bytes_per_s: intra.ok_or_else(|| missing("intra"))?,
                latency: lat[0].unwrap_or_default(),
            },
            inter: Link {
                bandwidth_bytes_per_s: inter.ok_or_else(|| missing("inter"))? * inter_factor,
                latency: lat[1].unwrap_or_default(),
            },
        })
    }
}

impl FromStr for LinkModel {
    type Err = CommError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "intra={}GB/s,inter={}GB/s,intra_latency={}ns,inter_latency={}ns",
            self.intra.bandwidth_bytes_per_s / 1e9,
            self.inter.bandwidth_bytes_per_s / 1e9,
            self.intra.latency.as_nanos(),
            self.inter.latency.as_nanos()
        )
    }
}

fn split_number(s: &str) -> Result<(f64, &str), CommError> {
    let end =
        s.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-'));
    // `e` may start a unit only in theory; no unit here starts with `e`.
    let (num, unit) = s.split_at(end.unwrap_or(s.len()));
    let v: f64 = num
        .parse()
        .map_err(|_| CommError::InvalidConfig(format!("link model: `{s}` does not start with a number")))?;
    Ok((v, unit.trim()))
}

fn parse_bandwidth(s: &str) -> Result<f64, CommError> {
    let (v, unit) = split_number(s)?;
    let factor = match unit {
        "B/s" => 1.0,
        "KB/s" | "kB/s" => 1e3,
        "MB/s" => 1e6,
        "GB/s" => 1e9,
        "TB/s" => 1e12,
        "KiB/s" => 1024.0,
        "MiB/s" => 1024.0 * 1024.0,
        "GiB/s" => 1024.0 * 1024.0 * 1024.0,
        "bit/s" | "b/s" | "bps" => 1.0 / 8.0,
        "Kbit/s" | "kbit/s" | "Kb/s" | "kb/s" | "Kbps" | "kbps" => 1e3 / 8.0,
        "Mbit/s" | "Mb/s" | "Mbps" => 1e6 / 8.0,
        "Gbit/s" | "Gb/s" | "Gbps" => 1e9 / 8.0,
        "Tbit/s" | "Tb/s" | "Tbps" => 1e12 / 8.0,
        other => {
            return Err(CommError::InvalidConfig(format!(
                "link model: unknown bandwidth unit `{other}` in `{s}`"
            )));
        }
    };
    let bw = v * factor;
    if !(bw.is_finite() && bw > 0.0) {
        return Err(CommError::InvalidConfig(format!("link model: bandwidth `{s}` must be positive")));
    }
    Ok(bw)
}

fn parse_latency(s: &str) -> Result<Duration, CommError> {
    let (v, unit) = split_number(s)?;
    let secs = match unit {
        "" if v == 0.0 => 0.0,
        "ns" => v * 1e-9,
        "us" | "µs" => v * 1e-6,
        "ms" => v * 1e-3,
        "s" => v,
        other => {
            return Err(CommError::InvalidConfig(format!(
                "link model: unknown latency unit `{other}` in `{s}`"
            )));
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|_| {
        CommError::InvalidConfig(format!("link model: latency `{s}` must be a non-negative duration"))
    })
}
