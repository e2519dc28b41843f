package gloo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ftcomm/ftcomm/comm"
)

// cgroupDir makes a cgroup (v1 controller ctl, or the v2 hierarchy) for a
// test, or skips the test when this machine does not let it. The cgroup
// is removed at cleanup (after the processes in it are gone).
func cgroupDir(t *testing.T, ctl string) (dir string, v2 bool) {
	t.Helper()
	name := fmt.Sprintf("gloo-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	for _, c := range []struct {
		root string
		v2   bool
	}{{"/sys/fs/cgroup/" + ctl, false}, {"/sys/fs/cgroup", true}} {
		if c.v2 {
			// cgroup2 mounted at /sys/fs/cgroup; the freezer is built in,
			// other controllers must be enabled for children.
			b, err := os.ReadFile("/sys/fs/cgroup/cgroup.subtree_control")
			if err != nil || ctl != "freezer" && !strings.Contains(" "+strings.TrimSpace(string(b))+" ", " "+ctl+" ") {
				continue
			}
		} else if _, err := os.Stat(c.root + "/cgroup.procs"); err != nil {
			continue
		}
		d := filepath.Join(c.root, name)
		if err := os.Mkdir(d, 0o755); err != nil {
			continue
		}
		t.Cleanup(func() { os.Remove(d) })
		return d, c.v2
	}
	t.Skipf("cannot make a %s cgroup here (needs root and cgroup v1 %s or v2)", ctl, ctl)
	return "", false
}

func writeFile(t *testing.T, path, s string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(s), 0o644); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// TestStarvedPeerNotDeclaredFailed starves a rank running in another
// process (a CPU quota of 2 ms per second) far past PeerTimeout: its
// silence is not a failure, because its process is runnable, and the
// all-reduces complete.
func TestStarvedPeerNotDeclaredFailed(t *testing.T) {
	dir, v2 := cgroupDir(t, "cpu")
	const n, victim, count = 2, 1, 64
	ch, comms, _ := processJob(t, n, victim, count, 300*time.Millisecond)
	// The child all-reduces in a loop; its ops and this rank's pair up.
	c := comms[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	buf := make([]float32, count)
	if err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum); err != nil {
		t.Fatal(err)
	}
	if v2 {
		writeFile(t, dir+"/cpu.max", "2000 1000000")
	} else {
		writeFile(t, dir+"/cpu.cfs_period_us", "1000000")
		writeFile(t, dir+"/cpu.cfs_quota_us", "2000")
	}
	writeFile(t, dir+"/cgroup.procs", strconv.Itoa(ch.cmd.Process.Pid))
	t.Cleanup(func() { ch.cmd.Process.Kill(); <-ch.done })
	b := backendOf(c)
	start := time.Now()
	for i := 0; time.Since(start) < 3*time.Second || i < 2; i++ {
		if err := c.AllReduce(ctx, comm.Float32s(buf), comm.Sum); err != nil {
			t.Fatalf("all-reduce %d with a starved peer: %v", i, err)
		}
	}
	// The starvation was real: the peer went silent for longer than
	// PeerTimeout (the gap decays, so this is a lower bound).
	if g := b.links[victim].heardAt.Gap(); g <= b.cfg.PeerTimeout {
		t.Errorf("longest recent gap between arrivals from the starved peer: %v, not above PeerTimeout %v", g, b.cfg.PeerTimeout)
	}
}

// TestFrozenCgroupPeerDetected freezes a rank in another process with the
// cgroup freezer (as `docker pause` does): its threads sleep in the kernel,
// not stopped, so the survivors declare it failed when it has been silent
// and never runnable for PeerTimeout.
func TestFrozenCgroupPeerDetected(t *testing.T) {
	dir, v2 := cgroupDir(t, "freezer")
	const n, victim, count = 3, 2, 1 << 12
	ch, comms, _ := processJob(t, n, victim, count, 500*time.Millisecond)
	writeFile(t, dir+"/cgroup.procs", strconv.Itoa(ch.cmd.Process.Pid))
	thaw := func() {
		if v2 {
			os.WriteFile(dir+"/cgroup.freeze", []byte("0"), 0o644)
		} else {
			os.WriteFile(dir+"/freezer.state", []byte("THAWED"), 0o644)
		}
	}
	t.Cleanup(func() { thaw(); ch.cmd.Process.Kill(); <-ch.done })
	started := make(chan struct{})
	go func() {
		<-started
		if v2 {
			writeFile(t, dir+"/cgroup.freeze", "1")
		} else {
			writeFile(t, dir+"/freezer.state", "FROZEN")
		}
	}()
	errs := loopUntilError(comms, count, started)
	for r, err := range errs {
		if r == victim {
			continue
		}
		if !errors.Is(err, comm.ErrPeerFailed) || rankOf(err) != victim || errors.Is(err, comm.ErrTimeout) {
			t.Errorf("rank %d: got %v, want ErrPeerFailed naming rank %d", r, err, victim)
		}
	}
}
