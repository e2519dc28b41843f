// Package membership is ftcomm's membership service: an etcd-backed
// comm.Store for rendezvous, and an etcd server embedded in the process for
// tests, tools and the default ftcoord.
//
// # Store
//
// NewStore(cli, prefix) keeps comm.Store keys under prefix in etcd. Get
// waits on a watch started at the revision after its first read (it never
// polls and never misses a write in between); Add is a compare-and-swap
// Txn loop storing decimal text. The caller owns the client.
//
// # Embedded etcd
//
// StartEmbedded runs one etcd member on free loopback ports (asked of the
// OS; never fixed), with etcd's logs silenced unless a logger is given.
// StartEmbeddedCluster runs several members forming one cluster. Close
// stops a member and removes its temporary data directory.
package membership
