module chorus.local/sip-bridge

go 1.26.8

require (
	github.com/livekit/protocol v1.50.5-0.20260728075222-28e604c046c6
	github.com/livekit/psrpc v0.7.2
	github.com/redis/go-redis/v9 v9.21.0
)
