"""The Streamlit monitoring page: reads workers' engine snapshots over HTTP and the latest bookings."""
