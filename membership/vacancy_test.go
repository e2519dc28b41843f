package membership_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/etcdhost"
	"github.com/ftcomm/ftcomm/internal/etcdkeys"
	"github.com/ftcomm/ftcomm/membership"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// WaitVacancy reports a rank of the group whose registration it saw and
// then saw deleted; a rank absent from the start (still launching), another
// group's members (also one whose name extends the group's), ranks outside
// the group's size and other keys are no vacancy.
func TestWaitVacancy(t *testing.T) {
	ctx, cli := vacancyEtcd(t)
	k := etcdkeys.Layout{Root: etcdkeys.DefaultRoot}
	put := func(id string) {
		if _, err := cli.Put(ctx, k.Member("job", id), "{}"); err != nil {
			t.Fatal(err)
		}
	}
	del := func(id string) {
		if _, err := cli.Delete(ctx, k.Member("job", id)); err != nil {
			t.Fatal(err)
		}
	}
	put("g.x.0")
	put("g.x.1") // rank 2 of g.x has not registered yet
	put("g.x.extra.0")
	put("other.1")
	got := make(chan int, 1)
	go func() {
		r, err := membership.WaitVacancy(ctx, cli, etcdkeys.DefaultRoot, "job", "g.x", 3, nil)
		if err != nil {
			t.Error(err)
		}
		got <- r
	}()
	// Noise the waiter must ignore, then the vacancy; the waiter may start
	// watching after some of it (a Get then shows it), which changes
	// nothing: none of it is a vacancy of g.x.
	del("g.x.extra.0")
	del("other.1")
	put("g.x.5") // outside the group's size
	del("g.x.5")
	put("g.x.2") // the late rank arrives …
	select {
	case r := <-got:
		t.Fatalf("vacancy %d before any rank of the group left", r)
	default:
	}
	del("g.x.1") // … and rank 1 dies
	select {
	case r := <-got:
		if r != 1 {
			t.Fatalf("vacancy %d, want 1", r)
		}
	case <-ctx.Done():
		t.Fatal("no vacancy reported")
	}
	if _, err := membership.WaitVacancy(ctx, cli, etcdkeys.DefaultRoot, "job", "g x", 3, nil); err == nil {
		t.Fatal("an invalid group name was accepted")
	}
}

// Two ranks die together; a spare that lost the race for the first free
// place asks again with what it saw, and gets the second at once.
func TestWaitVacancyRemembersWhatItSaw(t *testing.T) {
	ctx, cli := vacancyEtcd(t)
	k := etcdkeys.Layout{Root: etcdkeys.DefaultRoot}
	for _, id := range []string{"g.0", "g.1", "g.2"} {
		if _, err := cli.Put(ctx, k.Member("job", id), "{}"); err != nil {
			t.Fatal(err)
		}
	}
	seen := []bool{true, true, true} // as a waiter that watched all three register
	for _, id := range []string{"g.1", "g.2"} {
		if _, err := cli.Delete(ctx, k.Member("job", id)); err != nil {
			t.Fatal(err)
		}
	}
	r, err := membership.WaitVacancy(ctx, cli, etcdkeys.DefaultRoot, "job", "g", 3, seen)
	if err != nil || (r != 1 && r != 2) {
		t.Fatalf("first vacancy %d, %v", r, err)
	}
	// Another spare took that place; the other is still free.
	if _, err := cli.Put(ctx, k.Member("job", "g."+strconv.Itoa(r)), "{}"); err != nil {
		t.Fatal(err)
	}
	r2, err := membership.WaitVacancy(ctx, cli, etcdkeys.DefaultRoot, "job", "g", 3, seen)
	if err != nil || r2 != 3-r {
		t.Fatalf("second vacancy %d, %v; want %d", r2, err, 3-r)
	}
}

// vacancyEtcd starts an embedded etcd for the test and returns a client
// and a context that ends with the test (30 s at most).
func vacancyEtcd(t *testing.T) (context.Context, *clientv3.Client) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	e, err := etcdhost.StartEmbedded(ctx, etcdhost.DefaultEmbeddedConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	cli, err := membership.NewClient(e.Endpoints(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cli.Close() })
	return ctx, cli
}
