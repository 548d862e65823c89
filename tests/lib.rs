//! Workspace-level tests of zeropp and the helpers the crates' tests share.
//!
//! The integration tests that span several crates live in `tests/tests/*.rs`.
//! This library holds what more than one crate's tests need, so each helper
//! exists once:
//!
//! - [`data`]: finding the shared data files under `../shared/data` (relative
//!   to the workspace root), failing loudly when CI needs them and they are
//!   absent, and saying so in one counted line when a local run skips.
//! - [`gpu`]: the GPU suites' one `#[test]` each (quant's kernels, comm's
//!   device collectives and NCCL): every check on the device, or one counted
//!   skip line without one, a failure under `ZEROPP_REQUIRE_GPU=1`.
//! - [`fidelity`]: the two-sided acceptance rule for a training default, one
//!   definition for the CI check and the fidelity bench.
//!
//! Its doc tests are the Rust code a user pastes from `README.md` and
//! `docs/rust.md`: each ```` ```rust ```` block there compiles and runs in
//! `cargo test` (`-p zeropp-tests --doc`), so a guide that drifts from the API
//! fails the tests. (`docs/pytorch.md`'s recipe runs under torchrun in
//! `cargo xtask test-torch`; the `zeropp` lines of every guide are parsed by
//! the CLI's own tests.)

/// The README's Rust blocks, as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeRust;

/// `docs/rust.md`'s Rust blocks, as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../docs/rust.md")]
pub struct RustGuide;

pub mod data {
    //! The shared data files (`<workspace>/../shared/data/<name>`).
    //!
    //! A test that needs one calls [`require`]: it gets the path when the file
    //! exists; when it does not, the test fails under `CI=true` (set by CI) or
    //! `ZEROPP_REQUIRE_DATA=1` with a message naming the file and where it was
    //! looked for, and otherwise [`require`] writes one counted line to stderr
    //! (past the test harness's capture, so a skip is never silent) and returns
    //! `None`: the test returns early.
    //!
    //! ```
    //! use zeropp_tests::data;
    //! // A file that never exists: a skip outside CI, a panic under CI=true.
    //! if !data::required() {
    //!     assert!(data::require("no-such-file.txt", "doc_example").is_none());
    //! }
    //! assert!(data::path(data::TINYSHAKESPEARE).ends_with("shared/data/tinyshakespeare.txt"));
    //! ```

    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// The tiny Shakespeare corpus (about 1.1 MB of text, 65 distinct characters).
    pub const TINYSHAKESPEARE: &str = "tinyshakespeare.txt";

    /// Environment variable that makes a missing data file a failure (`1` or `true`).
    pub const REQUIRE_ENV: &str = "ZEROPP_REQUIRE_DATA";

    /// Where the file comes from, for the failure message.
    const SOURCES: &[(&str, &str)] = &[(
        TINYSHAKESPEARE,
        "the tiny Shakespeare corpus of char-rnn (public domain), which CI's shared/ folder provides",
    )];

    /// Tests skipped so far in this process for want of a data file.
    static SKIPPED: AtomicUsize = AtomicUsize::new(0);

    /// The path of data file `name`, whether or not it exists.
    pub fn path(name: &str) -> PathBuf {
        // This crate sits at `<workspace>/tests`.
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/data").join(name)
    }

    /// The path of data file `name` when it exists (no policy: for benches and
    /// optional extras).
    pub fn find(name: &str) -> Option<PathBuf> {
        let p = path(name);
        p.is_file().then_some(p)
    }

    /// Whether a missing data file fails the test: `CI` or
    /// [`REQUIRE_ENV`] set to `1` or `true`.
    pub fn required() -> bool {
        required_by(std::env::var("CI").ok().as_deref(), std::env::var(REQUIRE_ENV).ok().as_deref())
    }

    /// [`required`] on given values of `CI` and [`REQUIRE_ENV`].
    pub fn required_by(ci: Option<&str>, require: Option<&str>) -> bool {
        let on = |v: Option<&str>| {
            v.is_some_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
        };
        on(ci) || on(require)
    }

    /// The path of data file `name` for test `test`: `Some` when it exists;
    /// when it does not, a panic if [`required`], else one counted line on
    /// stderr (`skipped: 1 test needs ../shared/data/NAME`) and `None`.
    ///
    /// # Panics
    ///
    /// When the file is absent and [`required`] is true: under CI a test that
    /// needs data must not pass without it.
    pub fn require(name: &str, test: &str) -> Option<PathBuf> {
        require_if(required(), name, test)
    }

    /// [`require`] with the policy given (`required`) instead of read from the environment.
    fn require_if(required: bool, name: &str, test: &str) -> Option<PathBuf> {
        if let Some(p) = find(name) {
            return Some(p);
        }
        let shown = format!("../shared/data/{name}");
        if required {
            let from = SOURCES
                .iter()
                .find(|(n, _)| *n == name)
                .map_or_else(String::new, |(_, source)| format!(" (it is {source})"));
            panic!(
                "{test} needs {shown} (relative to the workspace root; looked for {}), which is absent{from}. \
                 CI=true or {REQUIRE_ENV}=1 makes a missing data file a failure rather than a skip.",
                path(name).display()
            );
        }
        let n = SKIPPED.fetch_add(1, Ordering::Relaxed) + 1;
        let (tests, needs) = if n == 1 { ("test", "needs") } else { ("tests", "need") };
        // Straight to stderr: the harness captures `eprintln!` of passing tests.
        let _ = writeln!(
            std::io::stderr(),
            "skipped: {n} {tests} {needs} {shown} (now: {test}; set {REQUIRE_ENV}=1 to make this a failure)"
        );
        None
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn ci_or_the_switch_requires_the_data() {
            assert!(!required_by(None, None));
            assert!(required_by(Some("true"), None));
            assert!(required_by(Some("TRUE"), None));
            assert!(required_by(None, Some("1")));
            assert!(!required_by(Some("false"), Some("0")));
            assert!(!required_by(Some(""), None));
        }

        #[test]
        #[should_panic(expected = "a_test needs ../shared/data/no-such-file.txt")]
        fn a_missing_file_fails_when_required() {
            require_if(true, "no-such-file.txt", "a_test");
        }

        #[test]
        fn a_missing_file_skips_otherwise() {
            let before = SKIPPED.load(Ordering::Relaxed);
            // This prints one `skipped:` line in every run, CI included: it is this
            // self-test of the mechanism, named so, not a skipped check.
            let test = "the skip counter's self-test (no real test skipped)";
            assert_eq!(require_if(false, "no-such-file.txt", test), None);
            assert!(SKIPPED.load(Ordering::Relaxed) > before);
        }

        #[test]
        fn the_path_is_under_shared_data() {
            let p = path(TINYSHAKESPEARE);
            assert!(p.ends_with("shared/data/tinyshakespeare.txt"), "{}", p.display());
            assert_eq!(find("no-such-file.txt"), None);
        }
    }
}

pub mod gpu {
    //! The GPU test suites: one `#[test]` runs every check of a suite, so a run
    //! without a device prints exactly one counted line
    //! (`gpu: N tests skipped: ...`), and [`REQUIRE_ENV`]`=1` makes a missing
    //! device a failure instead.
    //!
    //! ```
    //! use zeropp_tests::gpu;
    //! // No device here: one counted skip line (a panic under ZEROPP_REQUIRE_GPU=1).
    //! if !gpu::required(gpu::REQUIRE_ENV) {
    //!     let checks: gpu::Checks<u32> = &[("never runs", |_| unreachable!())];
    //!     gpu::suite(Err::<u32, _>("no device"), |_| String::new(), checks);
    //! }
    //! ```

    use std::fmt::Display;
    use std::io::Write;

    /// Environment variable that makes a missing device a failure (`1` or `true`).
    pub const REQUIRE_ENV: &str = "ZEROPP_REQUIRE_GPU";

    /// A suite's checks: each one's name and the check, run on the device `G`.
    pub type Checks<'a, G> = &'a [(&'a str, fn(&G))];

    /// Whether the environment variable `env` is `1` or `true`.
    pub fn required(env: &str) -> bool {
        std::env::var(env).is_ok_and(|v| matches!(v.trim().to_ascii_lowercase().as_str(), "1" | "true"))
    }

    /// Skips a suite of `checks` tests for `why`: one counted line on stderr.
    ///
    /// # Panics
    ///
    /// When [`required`]`(env)`: then a missing device (or library) is a failure.
    pub fn skip(checks: usize, why: &str, env: &str) {
        assert!(!required(env), "{env}=1 but {why}");
        // Straight to stderr: the harness captures `eprintln!` of passing tests.
        let _ = writeln!(
            std::io::stderr(),
            "gpu: {checks} tests skipped: {why} (set {env}=1 to make this a failure)"
        );
    }

    /// Runs every named check on the device `device` opened, after a line
    /// `gpu: {banner(device)}`, each check's name on a line before it; or, when
    /// the device could not be opened, [`skip`]s them all (env [`REQUIRE_ENV`]).
    pub fn suite<G, E: Display>(
        device: Result<G, E>,
        banner: impl FnOnce(&G) -> String,
        checks: Checks<'_, G>,
    ) {
        let device = match device {
            Ok(d) => d,
            Err(e) => return skip(checks.len(), &format!("no usable CUDA device ({e})"), REQUIRE_ENV),
        };
        let _ = writeln!(std::io::stderr(), "gpu: {}", banner(&device));
        for (name, check) in checks {
            let _ = writeln!(std::io::stderr(), "gpu: {name}");
            check(&device);
        }
    }
}

pub mod fidelity {
    //! The acceptance rule for a training default, judged on the per-seed ratios
    //! `val_loss(variant) / val_loss(ZeRO-3)` of the same seeds, in a calm
    //! regime (ZeRO-3's own seed-to-seed spread a few percent). It is
    //! **two-sided**: a variant far *better* than ZeRO-3 means the check is
    //! measuring luck, not fidelity, and fails too.
    //!
    //! ```
    //! use zeropp_tests::fidelity::CALM;
    //! let ok = CALM.judge(&[0.99, 1.0, 1.005, 0.98]);
    //! assert!(ok.passed(), "{ok}");
    //! let too_good = CALM.judge(&[0.95, 0.96, 0.96, 0.97]);
    //! assert!(!too_good.passed() && too_good.to_string().contains("below"));
    //! ```

    use std::fmt;
    use std::ops::RangeInclusive;

    /// Bounds on the mean ratio over the seeds and on every seed's ratio.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Rule {
        /// The mean ratio must lie in this range.
        pub mean: RangeInclusive<f64>,
        /// Every seed's ratio must lie in this range.
        pub seed: RangeInclusive<f64>,
    }

    /// The rule of issue 26: mean within [0.97, 1.01], every seed within [0.94, 1.03].
    pub const CALM: Rule =
        Rule { mean: RangeInclusive::new(0.97, 1.01), seed: RangeInclusive::new(0.94, 1.03) };

    /// A rule's verdict on some ratios, with the figures a report needs.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Judged {
        /// The per-seed ratios judged.
        pub ratios: Vec<f64>,
        /// Their mean.
        pub mean: f64,
        /// The standard error of the mean (0 for one seed).
        pub std_error: f64,
        /// The lowest seed's ratio.
        pub lowest: f64,
        /// The highest (worst) seed's ratio.
        pub worst: f64,
        /// Each broken bound, in words; empty when the rule is met.
        pub broken: Vec<String>,
    }

    impl Judged {
        /// Whether every bound holds.
        pub fn passed(&self) -> bool {
            self.broken.is_empty()
        }

        /// Whether the mean bound is broken (the seed bounds may hold).
        pub fn mean_broken(&self) -> bool {
            self.broken.iter().any(|b| b.starts_with("mean"))
        }
    }

    impl fmt::Display for Judged {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(
                f,
                "mean {:.4} ± {:.4}, seeds {:.4}..{:.4}, ratios {:.4?}: ",
                self.mean, self.std_error, self.lowest, self.worst, self.ratios
            )?;
            if self.broken.is_empty() {
                write!(f, "meets the rule")
            } else {
                write!(f, "{}", self.broken.join("; "))
            }
        }
    }

    impl Rule {
        /// Judges per-seed ratios (at least one).
        pub fn judge(&self, ratios: &[f64]) -> Judged {
            let n = ratios.len().max(1) as f64;
            let mean = ratios.iter().sum::<f64>() / n;
            let var = ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
            let std_error = if ratios.len() > 1 { (var / n).sqrt() } else { 0.0 };
            let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
            let worst = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut broken = Vec::new();
            if ratios.is_empty() || !mean.is_finite() {
                broken.push("mean: no finite ratios to judge".to_string());
            } else if mean < *self.mean.start() {
                broken.push(format!(
                    "mean {mean:.4} below {} (implausibly better: luck, or a check that cannot see)",
                    self.mean.start()
                ));
            } else if mean > *self.mean.end() {
                broken.push(format!("mean {mean:.4} above {}", self.mean.end()));
            }
            if worst > *self.seed.end() {
                broken.push(format!("a seed at {worst:.4}, above {}", self.seed.end()));
            }
            if lowest < *self.seed.start() {
                broken.push(format!("a seed at {lowest:.4}, below {}", self.seed.start()));
            }
            Judged { ratios: ratios.to_vec(), mean, std_error, lowest, worst, broken }
        }
    }

    /// Per-seed ratios `variant[i] / baseline[i]`.
    pub fn ratios(variant: &[f64], baseline: &[f64]) -> Vec<f64> {
        variant.iter().zip(baseline).map(|(a, b)| a / b).collect()
    }

    #[cfg(test)]
    mod tests {
        use super::CALM;

        #[test]
        fn each_bound_can_fail_on_its_own() {
            assert!(CALM.judge(&[1.0, 0.99, 1.005]).passed());
            let high = CALM.judge(&[1.02, 1.02, 1.01]);
            assert!(high.mean_broken() && high.broken.len() == 1, "{high}");
            let low = CALM.judge(&[0.96, 0.96, 0.965]);
            assert!(low.mean_broken() && low.broken.len() == 1, "{low}");
            let one_bad_seed = CALM.judge(&[0.99, 0.99, 0.99, 1.04]);
            assert!(!one_bad_seed.mean_broken() && !one_bad_seed.passed(), "{one_bad_seed}");
            let one_lucky_seed = CALM.judge(&[1.0, 1.0, 1.0, 0.93]);
            assert!(!one_lucky_seed.mean_broken() && !one_lucky_seed.passed(), "{one_lucky_seed}");
            assert!(!CALM.judge(&[]).passed());
            assert!(!CALM.judge(&[f64::NAN, 1.0]).passed());
        }
    }
}

pub mod heap {
    //! A counting global allocator for the memory tests (the engine's and the
    //! candle adapter's `tests/memory.rs`): live heap bytes, their peak and the
    //! largest block, over a measurement window.
    //!
    //! A test binary installs it with
    //! `#[global_allocator] static ALLOC: zeropp_tests::heap::Counting = zeropp_tests::heap::Counting;`,
    //! holds one test (so nothing else allocates meanwhile) and brackets the run
    //! with [`Window::start`].
    //!
    //! ```
    //! let w = zeropp_tests::heap::Window::start();
    //! // Without the allocator installed nothing is counted: the window stays empty.
    //! assert_eq!(w.peak(), 0);
    //! ```

    use std::alloc::{GlobalAlloc, Layout, System};
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

    /// The system allocator, counting live bytes, their peak and the largest block.
    pub struct Counting;

    static LIVE: AtomicUsize = AtomicUsize::new(0);
    static PEAK: AtomicUsize = AtomicUsize::new(0);
    static LARGEST: AtomicUsize = AtomicUsize::new(0);

    fn grew(by: usize, block: usize) {
        let now = LIVE.fetch_add(by, Relaxed) + by;
        PEAK.fetch_max(now, Relaxed);
        LARGEST.fetch_max(block, Relaxed);
    }

    // SAFETY: every method forwards to `System` with the caller's arguments
    // unchanged, so `System`'s guarantees hold; the counters are plain atomics.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded as is (the caller upholds `alloc`'s contract).
            let p = unsafe { System.alloc(layout) };
            if !p.is_null() {
                grew(layout.size(), layout.size());
            }
            p
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded as is.
            let p = unsafe { System.alloc_zeroed(layout) };
            if !p.is_null() {
                grew(layout.size(), layout.size());
            }
            p
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded as is: `ptr` came from this allocator with `layout`.
            unsafe { System.dealloc(ptr, layout) };
            LIVE.fetch_sub(layout.size(), Relaxed);
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: forwarded as is.
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                if new_size >= layout.size() {
                    grew(new_size - layout.size(), new_size);
                } else {
                    LIVE.fetch_sub(layout.size() - new_size, Relaxed);
                    LARGEST.fetch_max(new_size, Relaxed);
                }
            }
            p
        }
    }

    /// A measurement window: the heap's peak and largest block since [`Window::start`].
    pub struct Window {
        before: usize,
    }

    impl Window {
        /// Starts a window: resets the peak to the live bytes now and the largest block to 0.
        pub fn start() -> Self {
            let before = LIVE.load(Relaxed);
            PEAK.store(before, Relaxed);
            LARGEST.store(0, Relaxed);
            Self { before }
        }

        /// Peak live bytes above the start of the window.
        pub fn peak(&self) -> usize {
            PEAK.load(Relaxed).saturating_sub(self.before)
        }

        /// The largest single allocation in the window.
        pub fn largest(&self) -> usize {
            LARGEST.load(Relaxed)
        }
    }
}
