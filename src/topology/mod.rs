//! Which node(s) serve a lock's keys, and how many of them must agree.

pub(crate) mod fanout;
