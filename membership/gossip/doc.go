// Package gossip is SWIM failure detection (hashicorp/memberlist, with
// Lifeguard) among the members of ftcomm's jobs and its coordinators: a
// Node per member registration (named NodeName(job, id, lease), so that a
// coordinator maps a death to the registration it ends) and per
// coordinator. It is what package membership and package coordinator share
// underneath; users configure it through membership.GossipConfig (an alias
// of Config).
//
// # Lifecycle
//
// Start a Node, Join it to a few peers, read Events (join, leave, dead),
// Leave when going for good (peers then see a leave, not a death: each
// peer the node knows is told over TCP and answers before memberlist
// announces the leave), and Close.
//
// # Concurrency
//
// A Node is safe for concurrent use. It runs one goroutine that forwards
// events through an unbounded queue (a slow reader never stalls
// detection), and one short-lived goroutine per leave-handshake message
// it sends; Close waits for them. Nodes share nothing: several in one
// process form separate cells unless joined.
package gossip
