//! Where plugins, their policy and the e-stop latch live (`--plugins`, `--policy`, `--estop-file`,
//! `--no-plugins`), and the start-up check of them.

use anyhow::{Result, bail};
use std::path::PathBuf;
use thorn_plugin::components;

/// Where plugins, their policy and the compiled-code cache live.
#[derive(clap::Args, Clone)]
pub struct Place {
    /// Directory of installed plugins (default: <data dir>/plugins; the data dir is $THORN_DATA_DIR,
    /// $XDG_DATA_HOME/thorn or ~/.local/share/thorn).
    #[arg(
        long,
        global = true,
        help_heading = "Plugins",
        conflicts_with = "no_plugins"
    )]
    pub plugins: Option<PathBuf>,
    /// Serve the model alone: no plugin directory, no policy, no external MCP servers (benchmarks, a
    /// plain model endpoint).
    #[arg(long, global = true, help_heading = "Plugins")]
    pub no_plugins: bool,
    /// The operator's policy file (default: <data dir>/policy.json).
    #[arg(long, global = true, help_heading = "Plugins")]
    pub policy: Option<PathBuf>,
    /// Where the e-stop latch is kept across restarts (default: estop.json beside the policy file).
    #[arg(long, global = true, help_heading = "Plugins")]
    pub estop_file: Option<PathBuf>,
}

impl Place {
    /// The e-stop latch's file.
    pub fn estop_path(&self) -> PathBuf {
        self.estop_file
            .clone()
            .unwrap_or_else(|| self.resolve().1.with_file_name("estop.json"))
    }

    /// The e-stop latch, as the file keeps it.
    pub fn estop(&self) -> std::sync::Arc<thorn_plugin::Estop> {
        std::sync::Arc::new(thorn_plugin::Estop::load(&self.estop_path()))
    }

    /// The process's controls: the e-stop latch kept at [`Place::estop_path`], an empty approvals queue.
    pub fn controls(&self) -> thorn_plugin::Controls {
        thorn_plugin::Controls::new(self.estop())
    }

    /// Checks, before anything loads, what a command that serves plugins needs: a plugin directory named
    /// with `--plugins` must exist (an error naming it); with the default one missing, or plugins but no
    /// policy file, it says so (every plugin would be refused without a word otherwise).
    pub fn check(&self) -> Result<()> {
        if self.no_plugins {
            return Ok(());
        }
        let (dir, policy) = self.resolve();
        if !dir.is_dir() {
            if self.plugins.is_some() {
                bail!(
                    "the plugin directory {} (--plugins) does not exist; create it, or install plugins there with `thorn plugins install FILE --plugins {}`",
                    dir.display(),
                    dir.display()
                );
            }
            status!(
                "note: no plugins: {} does not exist (scripts/install-plugins installs the examples)",
                dir.display()
            );
            return Ok(());
        }
        let any = components(&dir).is_ok_and(|c| !c.is_empty());
        if any && !policy.is_file() {
            status!(
                "note: no policy file at {}: every plugin in {} is refused until approved (`thorn plugins approve NAME`)",
                policy.display(),
                dir.display()
            );
        }
        Ok(())
    }

    /// The plugin directory and the policy file.
    pub fn resolve(&self) -> (PathBuf, PathBuf) {
        let data = thorn::store::data_dir(None);
        (
            self.plugins.clone().unwrap_or_else(|| data.join("plugins")),
            self.policy
                .clone()
                .unwrap_or_else(|| data.join("policy.json")),
        )
    }
}
