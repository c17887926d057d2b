//! How statements reach PostgreSQL: requests pipelined on a connection ([`pipeline`]), the
//! store's statements prepared once per connection ([`prepared`]), a claim's transaction opened
//! and closed in the round trips around it ([`txn`]), and the clocks ([`clock`]). Nothing here
//! knows the tables or a claim's decision.

pub(crate) mod clock;
pub(crate) mod pipeline;
pub(crate) mod prepared;
pub(crate) mod txn;
