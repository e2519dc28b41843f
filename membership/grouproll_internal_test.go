package membership

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The roll's rule, step by step: a registration on the leader's lease
// other than its own is due for removal once it has been without a link
// for the bound (6 s here) since it appeared or since its last link
// ended, never while a hello is unread, once per attempt. Each step is
// "<time> <event> [<id>/<incarnation>]"; "due" lists what falls due then
// ("-": nothing) and, after "next", when the next one will.
func TestGroupRollScripts(t *testing.T) {
	for _, tc := range []struct {
		name  string
		steps []string
	}{
		{"an unlinked registration falls due at the bound, once", []string{
			"0s joined a/5",
			"5.9s due - next 6s",
			"6s due a/5",
			"7s due -",
		}},
		{"a link within the bound keeps it", []string{
			"0s joined a/5",
			"5.9s linked a/5",
			"100s due -",
		}},
		{"a hello before the joined record counts", []string{
			"0s linked a/5",
			"1s joined a/5",
			"100s due -",
		}},
		{"a link that ended with a goodbye starts the clock again", []string{
			"0s joined a/5",
			"1s linked a/5",
			"2s unlinked a/5",
			"7.9s due - next 8s",
			"8s due a/5",
		}},
		{"two links: the clock starts when the last one ends", []string{
			"0s linked a/5",
			"1s linked a/5",
			"2s unlinked a/5",
			"10s due -",
			"11s unlinked a/5",
			"17s due a/5",
		}},
		{"an unread hello holds every removal back", []string{
			"0s joined a/5",
			"5s opened",
			"6s due -",
			"6.5s read",
			"6.5s due a/5",
		}},
		{"the leader's own registration is not on the roll", []string{
			"0s joined self/3",
			"0s linked self/3",
			"1s unlinked self/3",
			"100s due -",
		}},
		{"a removal given up for a link keeps the registration on the roll", []string{
			"0s joined a/5",
			"6s due a/5",
			"6.1s linked a/5",
			"6.2s settled a/5",
			"100s due -",
			"101s unlinked a/5",
			"107s due a/5",
		}},
		{"a removal that ended drops it", []string{
			"0s joined a/5",
			"6s due a/5",
			"6.2s settled a/5",
			"6.3s linked a/5",
			"6.4s unlinked a/5",
			"12.3s due -",
			"12.4s due a/5",
		}},
		{"each incarnation is its own registration", []string{
			"0s joined a/5",
			"1s linked a/7",
			"6s due a/5",
			"100s due -",
		}},
		{"a registration that appears again has the bound again; one read from etcd keeps its time", []string{
			"0s joined a/5",
			"3s joined a/5",
			"4s found a/5",
			"6s due - next 9s",
			"9s due a/5",
			"9s found b/8",
			"15s due b/8",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := newGroupRoll("self", 6*time.Second)
			var t0 time.Time
			for _, step := range tc.steps {
				f := strings.Fields(step)
				d, err := time.ParseDuration(f[0])
				if err != nil || len(f) < 2 {
					t.Fatalf("step %q", step)
				}
				now := t0.Add(d)
				var k rollKey
				if len(f) > 2 {
					id, inc, _ := strings.Cut(f[2], "/")
					n, _ := strconv.ParseInt(inc, 10, 64)
					k = rollKey{id, n}
				}
				switch f[1] {
				case "joined":
					r.joined(k, now)
				case "found":
					r.found(k, now)
				case "linked":
					r.linked(k, now)
				case "unlinked":
					r.unlinked(k, now)
				case "settled":
					r.settled(k)
				case "opened":
					r.helloOpened()
				case "read":
					r.helloRead()
				case "due":
					due, next := r.due(now)
					got := "-"
					if len(due) > 0 {
						var ids []string
						for _, k := range due {
							ids = append(ids, fmt.Sprintf("%s/%d", k.id, k.inc))
						}
						got = strings.Join(ids, ",")
					}
					want := strings.Join(f[2:], " ")
					if strings.Contains(want, " next ") && !next.IsZero() {
						got += " next " + next.Sub(t0).String()
					}
					if got != want {
						t.Fatalf("%q: got %q", step, got)
					}
				default:
					t.Fatalf("step %q: no event %q", step, f[1])
				}
			}
		})
	}
}
