// Package httpstore is a comm.Store that one process hosts and the others
// reach over TCP: the rendezvous of ranks that share no etcd, as
// torch.distributed's TCPStore is for PyTorch (torchrun's MASTER_ADDR and
// MASTER_PORT name such a host). The Python package hosts one on rank 0.
//
//	srv, err := httpstore.Listen("127.0.0.1:0", httpstore.Config{})  // rank 0
//	defer srv.Close()
//	st := httpstore.NewClient(srv.Addr(), httpstore.Config{})       // every rank, rank 0 too
//	defer st.Close()
//	c, err := comm.New(ctx, "gloo", comm.Options{Rank: r, Size: n, Store: st})
//
// # Protocol
//
// HTTP/1.1 over one TCP listener: POST /set, /get, /add, /delete and
// /deleteprefix with the key in the query (k=) and a value in the body.
// A Get waits on the server until the key exists (a long poll, cancelled
// when the client's ctx ends), so ranks never poll. Config.Token, when
// set on both sides, must match (a bearer token); there is no TLS: bind
// the server to an interface only the job's hosts reach.
//
// # Lifecycle and concurrency
//
// Listen binds and serves at once; Close stops serving, wakes every
// waiting Get (its client sees comm.ErrClosed) and waits for the serving
// goroutine, which is the only one the Server starts besides those of
// net/http (one per connection, ended by Close). A Client is safe for
// concurrent use and starts no goroutine of its own; while the server
// cannot be reached (it has not started yet, say) a request is retried
// with backoff until its ctx ends, since the request never reached it.
// Separate Servers and Clients share nothing.
package httpstore
