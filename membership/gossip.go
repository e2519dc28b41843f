package membership

import "github.com/ftcomm/ftcomm/membership/gossip"

// GossipConfig configures failure detection by gossip (SWIM:
// hashicorp/memberlist with Lifeguard) among the members of jobs and the
// coordinators (MemberConfig.Gossip, coordinator.Config.Gossip). Its fields:
// BindAddr and AdvertiseAddr (host:port), the probe and suspicion timings,
// and SecretKey (16, 24 or 32 bytes: encrypts and authenticates gossip,
// so that a node without it cannot join and report deaths).
type GossipConfig = gossip.Config

// DefaultGossipConfig returns the fast LAN profile: a SIGKILLed or
// SIGSTOPped process is declared dead in about 1 s, with Lifeguard keeping
// a busy machine from suspecting healthy peers (docs/measurements.md).
func DefaultGossipConfig() GossipConfig { return gossip.DefaultConfig() }
