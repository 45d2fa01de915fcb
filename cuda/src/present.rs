//! Whether a library cudarc calls into is there, in either of cudarc's link modes. Loaded (every
//! build but the `cuda` one): cudarc opens the library at the first call and panics if it cannot,
//! so this asks cudarc's own loader first and looks up the symbols we call. Linked (`linked`, the
//! `cuda` build, where candle asks cudarc to link): the dynamic loader resolved every library
//! before `main`, so there is nothing to look for.

#[cfg(not(feature = "linked"))]
use crate::CudaError;
use crate::Result;

/// A library cudarc binds: its name for messages and how to find it when loaded.
#[derive(Clone, Copy)]
pub(crate) enum Lib {
    Driver,
    Nccl,
}

#[cfg(not(feature = "linked"))]
impl Lib {
    fn name(self) -> &'static str {
        match self {
            Lib::Driver => "libcuda",
            Lib::Nccl => "libnccl",
        }
    }

    fn missing(self) -> CudaError {
        match self {
            Lib::Driver => CudaError::NoDriver {
                why: not_found("cuda"),
            },
            Lib::Nccl => CudaError::NoNccl {
                why: not_found("nccl"),
            },
        }
    }
}

/// Why cudarc would find no `lib{name}`: the names it asks the loader for.
#[cfg(not(feature = "linked"))]
fn not_found(name: &str) -> String {
    let tried = cudarc::get_lib_name_candidates(name);
    let (first, last) = (tried.first(), tried.last());
    format!(
        "the dynamic loader finds none of the {} names cudarc tries for lib{name} ({} .. {}); a \
         library outside the loader's path is found through LD_LIBRARY_PATH",
        tried.len(),
        first.map_or("", String::as_str),
        last.map_or("", String::as_str),
    )
}

/// Ok when cudarc can call `symbols` of `lib` without panicking.
#[cfg(not(feature = "linked"))]
pub(crate) fn check(lib: Lib, symbols: &[&'static str]) -> Result<()> {
    // SAFETY: opening a library runs its initialisers; the driver's and NCCL's set up only their
    // own state. The library is closed again; cudarc opens it for good at its first call.
    let present = unsafe {
        match lib {
            Lib::Driver => cudarc::driver::sys::is_culib_present(),
            Lib::Nccl => cudarc::nccl::sys::is_culib_present(),
        }
    };
    if !present {
        return Err(lib.missing());
    }
    // SAFETY: cudarc opens the library it just found (the same names in the same order as its
    // presence check), so this does not reach cudarc's panic. The symbols are only looked up,
    // never called through these pointers.
    let handle = unsafe {
        match lib {
            Lib::Driver => cudarc::driver::sys::culib(),
            Lib::Nccl => cudarc::nccl::sys::culib(),
        }
    };
    for &symbol in symbols {
        // SAFETY: as above; the type is a plain pointer, nothing is called.
        if let Err(e) = unsafe { handle.get::<*const std::ffi::c_void>(symbol) } {
            return Err(CudaError::Symbol {
                library: lib.name(),
                symbol,
                why: e.to_string(),
            });
        }
    }
    Ok(())
}

/// Linked: the process would not have started without the library, and the linker checked
/// every symbol.
#[cfg(feature = "linked")]
pub(crate) fn check(_lib: Lib, _symbols: &[&'static str]) -> Result<()> {
    Ok(())
}

/// What the tests compare with: would cudarc find `lib`? Linked, it always does.
#[cfg(test)]
pub(crate) fn cudarc_finds(lib: Lib) -> bool {
    #[cfg(not(feature = "linked"))]
    // SAFETY: as in `check`.
    return unsafe {
        match lib {
            Lib::Driver => cudarc::driver::sys::is_culib_present(),
            Lib::Nccl => cudarc::nccl::sys::is_culib_present(),
        }
    };
    #[cfg(feature = "linked")]
    {
        let _ = lib;
        true
    }
}
