package etcdhost

import (
	"errors"
	"testing"

	"github.com/ftcomm/ftcomm/comm"
)

// Client and Close from two goroutines: whichever wins, the client Client
// returned is closed once Close returns, and (under -race) no data race.
// Before, Close read the client outside the Once that set it.
func TestEmbeddedClientRacesClose(t *testing.T) {
	e := startEtcd(t)
	got := make(chan error, 1)
	go func() {
		cli, err := e.Client()
		if err == nil {
			<-cli.Ctx().Done() // Close closes it
		}
		got <- err
	}()
	e.Close()
	if err := <-got; err != nil && !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("Client racing Close: %v", err)
	}
}

// Client after Close is refused (ErrClosed): before, it made a client of
// the stopped server that nobody closed.
func TestEmbeddedClientAfterClose(t *testing.T) {
	e := startEtcd(t)
	e.Close()
	cli, err := e.Client()
	if err == nil {
		cli.Close()
		t.Fatal("Client after Close returned a new client that nobody will close")
	}
	if !errors.Is(err, comm.ErrClosed) {
		t.Fatalf("Client after Close: %v, want ErrClosed", err)
	}
}
