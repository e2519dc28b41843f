// Package inproc is a comm.Backend whose ranks are goroutines of one
// process, exchanging buffers through shared memory. It is the reference
// implementation the network backends are checked against (every
// collective is computed the obvious way, from all ranks' inputs) and a
// fast backend for tests of the layers above comm.
//
// Ranks find each other through a Cluster, passed as
// comm.Options.BackendConfig: ranks of the same Cluster, Prefix and Epoch
// form one comm. Fail simulates a rank's death; Abort and Revoke behave as
// in the network backends (Revoke reaches every rank of the comm). A rank
// that starts Shrink or Grow posts nothing more on the old comm, and a peer
// whose op waits for it there fails with comm.ErrPeerClosed, as with gloo.
// A Cluster is safe for concurrent use; separate Clusters share nothing.
package inproc
