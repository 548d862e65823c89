//! The wheel as a user installs it: into a fresh venv, with no Rust toolchain
//! in reach. `cargo xtask test-torch` runs every Python test from such a venv.
//!
//! A fresh venv gets the wheel and nothing else of zeropp. Its other packages
//! (torch, numpy) come from a pinned venv through a `.pth` line, so that a new
//! venv per run costs a second, not torch's 7 GB install: pip sees them as
//! installed and checks the wheel's `numpy` requirement against them.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cmd::{root, run};

/// `~/.cache/zeropp`, where the tools' venvs live, outside any clone.
pub(crate) fn cache_dir() -> PathBuf {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    Path::new(&home).join(".cache/zeropp")
}

/// A venv at `dir` holding `pins`, made anew unless its stamp file says it
/// already holds exactly them.
pub(crate) fn pinned_venv(dir: &Path, pins: &[&str], what: &str) -> Result<PathBuf, String> {
    let stamp = dir.join("zeropp-pins.txt");
    let want = pins.join("\n");
    if dir.join("bin/python").is_file() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(dir.to_path_buf());
    }
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(|e| format!("{}: {e}", parent.display()))?;
    }
    let mut c = Command::new("python3");
    c.args(["-m", "venv", "--clear"]).arg(dir);
    run(&format!("a venv for {what}"), c)?;
    let mut c = Command::new(dir.join("bin/pip"));
    c.args(["install", "--quiet", "--disable-pip-version-check"]).args(pins);
    run(&format!("pip install {what}"), c)?;
    std::fs::write(&stamp, want).map_err(|e| format!("{}: {e}", stamp.display()))?;
    Ok(dir.to_path_buf())
}

/// The Python of `venv`'s `purelib` (its site-packages).
fn site_packages(venv: &Path) -> Result<PathBuf, String> {
    let out = Command::new(venv.join("bin/python"))
        .args(["-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
        .output()
        .map_err(|e| format!("{}: {e}", venv.display()))?;
    if !out.status.success() {
        return Err(format!("{}: cannot read its site-packages", venv.display()));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `PATH` without the folders that hold `cargo` or `rustc` (rustup's
/// `~/.cargo/bin`, a toolchain's `bin`). A system folder that holds them too
/// (Debian's packaged cargo in `/usr/bin`) cannot be dropped without the
/// system's tools: that is an error naming the fix, not a silent half-test.
pub(crate) fn path_without_rust() -> Result<std::ffi::OsString, String> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut kept = Vec::new();
    for dir in std::env::split_paths(&path) {
        if !dir.join("cargo").exists() && !dir.join("rustc").exists() {
            kept.push(dir);
        } else if ["/bin", "/usr/bin", "/usr/local/bin"].iter().any(|s| dir == Path::new(s)) {
            return Err(format!(
                "cargo or rustc is in {}, a system folder the wheel test cannot take off PATH; \
                 install Rust with rustup (into ~/.cargo/bin) to run the Python tests",
                dir.display()
            ));
        }
    }
    std::env::join_paths(kept).map_err(|e| format!("PATH: {e}"))
}

/// Runs `cmd` the way a user without Rust would: no cargo or rustc on its
/// `PATH`, and none of cargo's variables (`cargo xtask` runs under cargo).
pub(crate) fn without_rust(cmd: &mut Command) -> Result<&mut Command, String> {
    cmd.env("PATH", path_without_rust()?);
    for var in ["CARGO", "CARGO_HOME", "RUSTC", "RUSTUP_HOME", "RUSTUP_TOOLCHAIN", "CARGO_MANIFEST_DIR"] {
        cmd.env_remove(var);
    }
    Ok(cmd)
}

/// A fresh venv at `dir` (anything there before is removed) holding `wheel`,
/// with `base`'s packages beside it.
pub(crate) fn install(dir: &Path, base: &Path, wheel: &Path) -> Result<PathBuf, String> {
    let base_site = site_packages(base)?;
    // A zeropp in the base venv (an older checkout's `pip install ./python`)
    // would sit on the path too: take it out.
    if base_site.join("zeropp").exists() {
        let mut c = Command::new(base.join("bin/pip"));
        c.args(["uninstall", "--yes", "--quiet", "zeropp"]);
        run("pip uninstall an older zeropp from the base venv", c)?;
    }
    let mut c = Command::new("python3");
    c.args(["-m", "venv", "--clear"]).arg(dir);
    run(&format!("a fresh venv for the wheel ({})", dir.display()), c)?;
    let site = site_packages(dir)?;
    std::fs::write(site.join("zeropp-base.pth"), format!("{}\n", base_site.display()))
        .map_err(|e| format!("{}: {e}", site.display()))?;
    let mut c = Command::new(dir.join("bin/python"));
    c.args(["-m", "pip", "install", "--quiet", "--no-index", "--disable-pip-version-check"])
        .arg(wheel)
        .current_dir(root().join("target"));
    without_rust(&mut c)?;
    run("pip install the wheel (no cargo or rustc on PATH)", c)?;
    Ok(dir.to_path_buf())
}

/// The workspace's version (`[workspace.package] version` in Cargo.toml),
/// the one the crates and the wheel carry.
pub(crate) fn workspace_version() -> Result<String, String> {
    let manifest = root().join("Cargo.toml");
    let text = std::fs::read_to_string(&manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let section = text.split("[workspace.package]").nth(1).ok_or("Cargo.toml has no [workspace.package]")?;
    section
        .lines()
        .take_while(|l| !l.starts_with('['))
        .find_map(|l| l.strip_prefix("version = ").map(|v| v.trim().trim_matches('"').to_string()))
        .ok_or_else(|| "no version in [workspace.package]".into())
}

/// `python/tests/installed.py` in `venv` against `wheel`, from outside the
/// source tree and without Rust.
pub(crate) fn check_command(venv: &Path, wheel: &Path) -> Result<Command, String> {
    let mut c = Command::new(venv.join("bin/python"));
    c.arg(root().join("python/tests/installed.py"))
        .arg("--source")
        .arg(root().join("python/zeropp"))
        .args(["--version", &workspace_version()?])
        .arg("--wheel")
        .arg(wheel)
        .current_dir(root().join("target"));
    without_rust(&mut c)?;
    Ok(c)
}

/// A copy of `wheel` without `member` (and its RECORD line), in `dir`: the
/// seeded defect of a wheel that lacks a file the source tree has.
pub(crate) fn without_member(wheel: &Path, member: &str, dir: &Path) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let name = wheel.file_name().ok_or("the wheel has no file name")?;
    let out = dir.join(name);
    let script = "import sys, zipfile\n\
        src, dst, drop = sys.argv[1:4]\n\
        with zipfile.ZipFile(src) as a, zipfile.ZipFile(dst, 'w', zipfile.ZIP_DEFLATED) as b:\n\
        \x20   names = a.namelist()\n\
        \x20   assert drop in names, f'{drop} is not in the wheel'\n\
        \x20   for n in names:\n\
        \x20       if n == drop:\n\
        \x20           continue\n\
        \x20       data = a.read(n)\n\
        \x20       if n.endswith('.dist-info/RECORD'):\n\
        \x20           data = b''.join(l for l in data.splitlines(True) if not l.startswith(drop.encode() + b','))\n\
        \x20       b.writestr(a.getinfo(n), data)\n";
    let mut c = Command::new("python3");
    c.args(["-c", script]).arg(wheel).arg(&out).arg(member);
    run(&format!("seed the defect: the wheel without {member}"), c)?;
    Ok(out)
}
