//! Writing a plugin outside thorn's tree: `thorn plugins new NAME` writes a crate of its own (the SDK as a
//! dependency, one function with a schema, an example, an answer template and a unit test), and `thorn
//! plugins build [DIR]` builds it into a component (the wasm32-wasip2 target added when missing) and prints
//! the component's path on its last line.

use anyhow::{Context, Result, bail};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;

/// `thorn plugins new`.
#[derive(clap::Args)]
pub struct NewArgs {
    /// The plugin's name: lower-case letters, digits and `_`, starting with a letter (its functions are
    /// called by it in requests: `thorn:NAME`).
    pub name: String,
    /// The directory the crate's folder is made in.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// The SDK crate (`thorn-plugin-sdk`) to depend on by path (default: the one in the thorn checkout
    /// this binary was built from, when it is there).
    #[arg(long, env = "THORN_PLUGIN_SDK", conflicts_with = "sdk_git")]
    pub sdk: Option<PathBuf>,
    /// Depend on the SDK from a git repository of thorn instead (cargo finds the `thorn-plugin-sdk`
    /// package inside it): its URL.
    #[arg(long)]
    pub sdk_git: Option<String>,
    /// With --sdk-git: the commit, tag or branch to pin (a commit: `rev`; otherwise what cargo calls
    /// the default branch).
    #[arg(long, requires = "sdk_git")]
    pub sdk_rev: Option<String>,
}

/// The dependency line for the SDK.
fn sdk_dependency(a: &NewArgs) -> Result<String> {
    if let Some(url) = &a.sdk_git {
        return Ok(match &a.sdk_rev {
            Some(rev) => format!("{{ git = {url:?}, rev = {rev:?} }}"),
            None => format!("{{ git = {url:?} }}"),
        });
    }
    match a.sdk.clone().or_else(checkout_sdk) {
        Some(p) => {
            let p =
                std::fs::canonicalize(&p).with_context(|| format!("the SDK at {}", p.display()))?;
            Ok(format!("{{ path = {:?} }}", p.display().to_string()))
        }
        None => bail!(
            "no thorn-plugin-sdk found: pass --sdk PATH (the `plugins/sdk` folder of a thorn checkout) or --sdk-git URL, or set THORN_PLUGIN_SDK"
        ),
    }
}

/// `thorn plugins build`.
#[derive(clap::Args)]
pub struct BuildArgs {
    /// The plugin crate's directory.
    #[arg(default_value = ".")]
    pub dir: PathBuf,
}

/// The SDK of the checkout this binary was built from, if it is still there.
fn checkout_sdk() -> Option<PathBuf> {
    let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/sdk");
    sdk.join("Cargo.toml")
        .is_file()
        .then(|| std::fs::canonicalize(&sdk).ok())
        .flatten()
}

/// Writes the crate.
pub fn new(a: &NewArgs) -> Result<()> {
    let name = &a.name;
    let valid = name.len() <= 32
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if !valid {
        bail!(
            "{name:?} is not a plugin name: lower-case letters, digits and `_`, starting with a letter, at most 32"
        );
    }
    let root = a.dir.join(name);
    if root.exists() {
        bail!(
            "{} already exists; choose another --dir or name",
            root.display()
        );
    }
    let sdk = sdk_dependency(a)?;
    std::fs::create_dir_all(root.join("src"))?;
    std::fs::create_dir_all(root.join(".cargo"))?;
    std::fs::write(
        root.join("Cargo.toml"),
        TEMPLATE_CARGO
            .replace("{name}", name)
            .replace("{sdk}", &sdk),
    )?;
    std::fs::write(
        root.join(".cargo/config.toml"),
        "[build]\ntarget = \"wasm32-wasip2\"\n",
    )?;
    std::fs::write(
        root.join("src/lib.rs"),
        TEMPLATE_LIB.replace("{name}", name),
    )?;
    std::fs::write(root.join(".gitignore"), "/target\n")?;
    println!("wrote the plugin crate {}", root.display());
    println!("  build:   thorn plugins build {}", root.display());
    println!(
        "  test:    (cd {} && cargo test --target \"$(rustc -vV | sed -n 's/^host: //p')\")",
        root.display()
    );
    println!("  install: thorn plugins install PATH_BUILD_PRINTS --approve");
    println!("  try:     thorn plugins call {name} shout '{{\"text\": \"hello\"}}'");
    Ok(())
}

/// Builds the crate in `a.dir` for wasm32-wasip2; prints the component's path last.
pub fn build(a: &BuildArgs) -> Result<()> {
    let manifest = a.dir.join("Cargo.toml");
    if !manifest.is_file() {
        bail!(
            "{} has no Cargo.toml: give the plugin crate's directory",
            a.dir.display()
        );
    }
    add_target()?;
    let meta = Command::new("cargo")
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--manifest-path",
        ])
        .arg(&manifest)
        .output()
        .context("running cargo metadata")?;
    if !meta.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&meta.stderr).trim()
        );
    }
    let meta: Value = serde_json::from_slice(&meta.stdout)?;
    let manifest_abs = std::fs::canonicalize(&manifest)?;
    let package = meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| {
            p["manifest_path"]
                .as_str()
                .is_some_and(|m| Path::new(m) == manifest_abs)
        })
        .context("cargo metadata does not list the crate")?;
    let lib = package["targets"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|t| {
            t["crate_types"]
                .as_array()
                .is_some_and(|c| c.iter().any(|x| x == "cdylib"))
        })
        .and_then(|t| t["name"].as_str())
        .context("the crate has no cdylib library (crate-type = [\"cdylib\"]): a plugin is one")?
        .replace('-', "_");
    let status = Command::new("cargo")
        .args([
            "build",
            "--release",
            "--target",
            "wasm32-wasip2",
            "--manifest-path",
        ])
        .arg(&manifest)
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("cargo build failed ({status})");
    }
    let target_dir = meta["target_directory"]
        .as_str()
        .context("cargo metadata names no target directory")?;
    let wasm = Path::new(target_dir)
        .join("wasm32-wasip2/release")
        .join(format!("{lib}.wasm"));
    if !wasm.is_file() {
        bail!("the build made no {}", wasm.display());
    }
    println!("{}", wasm.display());
    Ok(())
}

/// Adds the wasm32-wasip2 target through rustup when it is not installed.
fn add_target() -> Result<()> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output();
    match installed {
        Ok(o)
            if String::from_utf8_lossy(&o.stdout)
                .lines()
                .any(|l| l.trim() == "wasm32-wasip2") =>
        {
            Ok(())
        }
        Ok(_) => {
            eprintln!("adding the wasm32-wasip2 target (rustup target add wasm32-wasip2)");
            let ok = Command::new("rustup")
                .args(["target", "add", "wasm32-wasip2"])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                bail!("`rustup target add wasm32-wasip2` failed");
            }
            Ok(())
        }
        // No rustup: the toolchain is managed otherwise; cargo says so if the target is missing.
        Err(_) => Ok(()),
    }
}

const TEMPLATE_CARGO: &str = r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"
publish = false

[lib]
# cdylib: the component; rlib: the unit tests on the host.
crate-type = ["cdylib", "rlib"]

[dependencies]
thorn-plugin-sdk = {sdk}
serde = { version = "1", features = ["derive"] }
schemars = "1"

# A crate of its own, not a member of any workspace around it.
[workspace]

[profile.release]
opt-level = "s"
lto = true
strip = true
codegen-units = 1
"#;

const TEMPLATE_LIB: &str = r#"//! The {name} tool plugin: one function, `shout`. Build it with `thorn plugins build`, test it on the host
//! with `cargo test --target $(rustc -vV | sed -n 's/^host: //p')`.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use thorn_plugin_sdk::{Plugin, json};

/// The arguments of `shout`: the model fills them, validated against the schema derived from this type.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Shout {
    /// The text to shout.
    pub text: String,
}

/// What `shout` returns.
#[derive(Serialize, JsonSchema)]
pub struct Shouted {
    /// The text in capitals, with an exclamation mark.
    pub text: String,
}

/// Shouts `text`. An `Err` goes back to the model as the tool's error message.
pub fn shout(a: Shout) -> Result<Shouted, String> {
    if a.text.trim().is_empty() {
        return Err("give some text to shout".into());
    }
    Ok(Shouted {
        text: format!("{}!", a.text.trim().to_uppercase()),
    })
}

thorn_plugin_sdk::plugin!(
    Plugin::new("{name}", "0.1.0", "Shouts text back in capitals.")
        .function("shout", "Repeats the given text in capital letters.", shout)
        // An earlier turn the model sees: a request and the call it should make.
        .example("Shout hello.", json!({"text": "hello"}))
        // The answer, without another round of the model.
        .answer("{{ result.text }}")
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shouts_and_refuses_nothing() {
        let out = shout(Shout { text: "hello".into() }).unwrap();
        assert_eq!(out.text, "HELLO!");
        assert!(shout(Shout { text: " ".into() }).is_err());
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdk_is_a_path_or_a_pinned_git_dependency() {
        let args = |sdk: Option<PathBuf>, git: Option<&str>, rev: Option<&str>| NewArgs {
            name: "demo".into(),
            dir: ".".into(),
            sdk,
            sdk_git: git.map(str::to_owned),
            sdk_rev: rev.map(str::to_owned),
        };
        let url = "https://git.example/thorn.git";
        assert_eq!(
            sdk_dependency(&args(None, Some(url), Some("0123abc"))).unwrap(),
            r#"{ git = "https://git.example/thorn.git", rev = "0123abc" }"#
        );
        assert_eq!(
            sdk_dependency(&args(None, Some(url), None)).unwrap(),
            r#"{ git = "https://git.example/thorn.git" }"#
        );
        let sdk = Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/sdk");
        let line = sdk_dependency(&args(Some(sdk.clone()), None, None)).unwrap();
        let want = std::fs::canonicalize(&sdk).unwrap();
        assert_eq!(
            line,
            format!("{{ path = {:?} }}", want.display().to_string())
        );
        assert!(sdk_dependency(&args(Some("/nowhere/sdk".into()), None, None)).is_err());
    }
}
