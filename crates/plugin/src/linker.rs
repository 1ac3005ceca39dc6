//! The WASI preview 2 imports a plugin is linked against: wasmtime-wasi's, with two narrowed.
//!
//! * **Name lookups** (`wasi:sockets/ip-name-lookup`) resolve only the host names of the plugin's network
//!   grant (and IP literals, which need no resolver). Any other name is refused before a resolver sees it:
//!   a lookup is itself a message to the outside (`<secret>.attacker.example` reaches the attacker's name
//!   server), so an allow-list of connections does not cover it. wasmtime-wasi turns lookups on or off as a
//!   whole; this wraps its implementation with the per-store allow-list in [`State`].
//! * **Symbolic links** cannot be created (`descriptor.symlink-at` fails with `not-permitted`). A read-write
//!   grant would otherwise let a guest plant a link (even a relative one) that points out of the granted
//!   directory: harmless to the guest, which cannot follow it out, but not to the host's programs or to
//!   other plugins sharing the directory. Read-only grants already refuse every mutation.

use crate::sandbox::State;
use wasmtime::component::{HasData, Linker, Resource};
use wasmtime_wasi::p2::SocketError;
use wasmtime_wasi::p2::bindings::filesystem::types::{Descriptor, ErrorCode as FsErrorCode};
use wasmtime_wasi::p2::bindings::sockets::ip_name_lookup::{
    self, Host, HostResolveAddressStream, ResolveAddressStream,
};
use wasmtime_wasi::p2::bindings::sockets::network::{self, ErrorCode, IpAddress, Network};
use wasmtime_wasi::sockets::WasiSocketsCtxView;

/// The interface whose `symlink-at` is replaced (wasmtime-wasi is pinned, so its WIT version is fixed).
const FILESYSTEM_TYPES: &str = "wasi:filesystem/types@0.2.12";

/// The linker every plugin is instantiated with.
pub(super) fn linker(engine: &wasmtime::Engine) -> wasmtime::Result<Linker<State>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    linker.allow_shadowing(true);
    ip_name_lookup::add_to_linker::<State, Lookups>(&mut linker, |s: &mut State| Filtered {
        names: &s.lookup_names,
        inner: WasiSocketsCtxView {
            ctx: s.wasi.sockets(),
            table: &mut s.table,
        },
    })?;
    linker.instance(FILESYSTEM_TYPES)?.func_wrap(
        "[method]descriptor.symlink-at",
        |_, (_dir, _old, _new): (Resource<Descriptor>, String, String)| {
            Ok((Err::<(), _>(FsErrorCode::NotPermitted),))
        },
    )?;
    linker.allow_shadowing(false);
    Ok(linker)
}

/// Whether a guest may look `name` up, given the host names it was granted (lower case).
pub(super) fn may_resolve(granted: &[String], name: &str) -> bool {
    let bare = name.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<std::net::IpAddr>().is_ok() {
        return true; // a literal: answered without a resolver
    }
    let name = name.strip_suffix('.').unwrap_or(name);
    granted.iter().any(|g| g.eq_ignore_ascii_case(name))
}

struct Lookups;

impl HasData for Lookups {
    type Data<'a> = Filtered<'a>;
}

/// wasmtime-wasi's lookups behind the store's allow-list.
struct Filtered<'a> {
    names: &'a [String],
    inner: WasiSocketsCtxView<'a>,
}

impl Host for Filtered<'_> {
    fn resolve_addresses(
        &mut self,
        network: Resource<Network>,
        name: String,
    ) -> Result<Resource<ResolveAddressStream>, SocketError> {
        if !may_resolve(self.names, &name) {
            tracing::debug!(%name, "a plugin's name lookup outside its grant was refused");
            return Err(ErrorCode::PermanentResolverFailure.into());
        }
        Host::resolve_addresses(&mut self.inner, network, name)
    }
}

// What the lookup interface needs of the network interface (error conversion), as wasmtime-wasi does it.
impl network::Host for Filtered<'_> {
    fn convert_error_code(&mut self, error: SocketError) -> wasmtime::Result<ErrorCode> {
        network::Host::convert_error_code(&mut self.inner, error)
    }

    fn network_error_code(
        &mut self,
        err: Resource<network::Error>,
    ) -> wasmtime::Result<Option<ErrorCode>> {
        network::Host::network_error_code(&mut self.inner, err)
    }
}

impl network::HostNetwork for Filtered<'_> {
    fn drop(&mut self, this: Resource<Network>) -> wasmtime::Result<()> {
        network::HostNetwork::drop(&mut self.inner, this)
    }
}

impl HostResolveAddressStream for Filtered<'_> {
    fn resolve_next_address(
        &mut self,
        stream: Resource<ResolveAddressStream>,
    ) -> Result<Option<IpAddress>, SocketError> {
        HostResolveAddressStream::resolve_next_address(&mut self.inner, stream)
    }

    fn subscribe(
        &mut self,
        stream: Resource<ResolveAddressStream>,
    ) -> wasmtime::Result<Resource<wasmtime_wasi::p2::DynPollable>> {
        HostResolveAddressStream::subscribe(&mut self.inner, stream)
    }

    fn drop(&mut self, stream: Resource<ResolveAddressStream>) -> wasmtime::Result<()> {
        HostResolveAddressStream::drop(&mut self.inner, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_granted_names_and_literals_resolve() {
        let granted = vec!["api.example.com".to_owned()];
        assert!(may_resolve(&granted, "api.example.com"));
        assert!(may_resolve(&granted, "API.Example.com."));
        assert!(may_resolve(&granted, "127.0.0.1"));
        assert!(may_resolve(&granted, "::1"));
        assert!(may_resolve(&granted, "[::1]"));
        assert!(!may_resolve(&granted, "secret.attacker.example"));
        assert!(!may_resolve(&granted, "example.com"));
        assert!(!may_resolve(&granted, "x.api.example.com"));
        assert!(!may_resolve(&[], "localhost"));
    }
}
