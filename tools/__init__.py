"""The concierge's hotel tools: what the model may call (schemas.py), the hotel's operations behind them
(hotel.py) and the booking store (store/). Knows nothing of audio, LiveKit or the engine."""
