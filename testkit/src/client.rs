//! One way for the tests to make a `redbaton` client: [`lock_builder!`](crate::lock_builder)
//! and [`lock_client!`](crate::lock_client), so that each test names only the settings it
//! is about and a client that cannot be built fails the test with what was asked for.
//!
//! They are macros because this crate does not depend on `redbaton` (see the crate
//! documentation): the expansion names `::redbaton`, which the crate that uses them
//! depends on.
//!
//! Settings are the builder's own methods, written as calls and applied in order:
//! `lock_client!(node(url), key_prefix("p:"), lease(secs(30)))`. One shorthand:
//! `io_timeouts(d)` sets the connect, read and write timeouts to `d`, the bound the
//! tests of failover and migration use for every network step. And `patient()`: a lease
//! and a re-check interval of a minute, so that a wait ends only by a message (or its
//! deadline), its re-checks and its holders' lease hints coming long after the test.

/// A `redbaton::Builder` with `settings` applied in order (builder methods written as
/// calls, plus `io_timeouts(d)` for the connect, read and write timeouts at once and
/// `patient()` for a minute's lease and re-check interval).
///
/// ```ignore
/// let b = lock_builder!(node(srv.url()), lease(secs(2)));
/// assert!(b.lease(Duration::ZERO).build().is_err());
/// ```
#[macro_export]
macro_rules! lock_builder {
    ($($settings:tt)*) => {
        $crate::__lock_settings!(::redbaton::LockClient::builder(); $($settings)*)
    };
}

/// A `redbaton::LockClient` built from `settings` as [`lock_builder!`](crate::lock_builder)
/// takes them; a client that cannot be built fails the test with the settings and the
/// error.
///
/// ```ignore
/// let client = lock_client!(node(srv.url()), key_prefix("rw:"));
/// ```
#[macro_export]
macro_rules! lock_client {
    ($($settings:tt)*) => {
        $crate::lock_builder!($($settings)*)
            .build()
            .unwrap_or_else(|e| panic!("build a client with {}: {e}", stringify!($($settings)*)))
    };
}

/// Applies the settings of [`lock_builder!`](crate::lock_builder) one at a time.
#[doc(hidden)]
#[macro_export]
macro_rules! __lock_settings {
    ($b:expr;) => { $b };
    ($b:expr; io_timeouts($d:expr) $(, $($rest:tt)*)?) => {{
        let d: ::std::time::Duration = $d;
        $crate::__lock_settings!(
            $b.connect_timeout(d).read_timeout(d).write_timeout(d); $($($rest)*)?
        )
    }};
    ($b:expr; patient() $(, $($rest:tt)*)?) => {{
        let minute = ::std::time::Duration::from_secs(60);
        $crate::__lock_settings!($b.lease(minute).recheck_interval(minute); $($($rest)*)?)
    }};
    ($b:expr; $setting:ident($($arg:expr),* $(,)?) $(, $($rest:tt)*)?) => {
        $crate::__lock_settings!($b.$setting($($arg),*); $($($rest)*)?)
    };
}

/// A waiter on `name` in a thread of its own: `client.try_lock_for(name, within)`, then
/// the unlock of the guard it got, which must say `Released`. The handle gives the time
/// it got the lock. A macro for the same reason as [`lock_client!`](crate::lock_client).
///
/// ```ignore
/// let waiting = timed_waiter!(&client, "name", secs(20));
/// let got: Instant = waiting.join().expect("the waiter");
/// ```
#[macro_export]
macro_rules! timed_waiter {
    ($client:expr, $name:expr, $within:expr) => {{
        let client: ::redbaton::LockClient = ::std::clone::Clone::clone($client);
        let name: ::std::string::String = ::std::borrow::ToOwned::to_owned($name);
        let within: ::std::time::Duration = $within;
        ::std::thread::spawn(move || {
            let guard = client
                .try_lock_for(&name, within)
                .expect("the waiter's lock");
            let got = ::std::time::Instant::now();
            assert_eq!(
                guard.unlock().expect("the waiter's unlock"),
                ::redbaton::Unlocked::Released
            );
            got
        })
    }};
}
